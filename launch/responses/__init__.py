"""OpenAI's Responses API (POST /v1/responses) over the chat path: the request, the response, the events."""
