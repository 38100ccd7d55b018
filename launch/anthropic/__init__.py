"""Anthropic's Messages API (POST /v1/messages) over the chat path: the request, the message, the events."""
