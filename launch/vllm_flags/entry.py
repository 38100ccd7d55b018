"""One vLLM serve flag's answer here (a notice, a refusal or our name for it), and the builders the tables use."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Answer(enum.Enum):
    NOTICE = "notice"  # accepted, with one line on stderr: it changes nothing here
    REFUSE = "refuse"  # exit 1 with what it means in vLLM, what it is here and what to use
    RENAME = "rename"  # vLLM's other name for a flag of ours: rewritten to ours


class Takes(enum.Enum):
    NOTHING = "switch"  # a switch: --flag
    ONE = "one"  # --flag VALUE or --flag=VALUE
    MANY = "many"  # vLLM's nargs='+': --flag A B C (every token up to the next option)


@dataclass(frozen=True, slots=True)
class VllmFlag:
    names: tuple[str, ...]  # vLLM's option strings for it: the long name first, then its short aliases
    takes: Takes
    answer: Answer
    text: str  # NOTICE/REFUSE: what it is in vLLM and here (and what to use); RENAME: our option string
    accepted: tuple[str, ...] = ()  # REFUSE only: values that change nothing here (lowercase), noticed instead

    @property
    def name(self) -> str:
        return self.names[0]

    def is_accepted(self, values: list[str]) -> bool:
        return bool(values) and all(v.replace(" ", "").lower() in self.accepted for v in values)


# "--name|-alias" takes one value; a trailing "!" marks a switch, a trailing "+" several values (nargs='+')
_SUFFIXES = {"!": Takes.NOTHING, "+": Takes.MANY}


def _parse(specs: str) -> list[tuple[tuple[str, ...], Takes]]:
    parsed = []
    for spec in specs.split():
        takes = _SUFFIXES.get(spec[-1], Takes.ONE)
        parsed.append((tuple(spec.rstrip("!+").split("|")), takes))
    return parsed


def notice(text: str, specs: str) -> tuple[VllmFlag, ...]:
    """Flags that change nothing here: `text` says why."""
    return tuple(VllmFlag(names, takes, Answer.NOTICE, text) for names, takes in _parse(specs))


def refuse(text: str, specs: str, accepted: tuple[str, ...] = ()) -> tuple[VllmFlag, ...]:
    """Flags this runtime cannot honour (but for the `accepted` values): `text` says what to use."""
    return tuple(VllmFlag(names, takes, Answer.REFUSE, text, accepted) for names, takes in _parse(specs))


def rename(spec: str, ours: str) -> tuple[VllmFlag, ...]:
    """vLLM's other option string for a flag of ours (its negative form, an alias)."""
    return tuple(VllmFlag(names, takes, Answer.RENAME, ours) for names, takes in _parse(spec))


# texts more than one table uses
KERNELS = ("a kernel or backend choice; here the runtime's own kernels (Triton on a GPU, torch on a CPU), not "
           "configurable")
MULTINODE = ("multi-node serving by hand; here `shardserve cluster up` on one node and `cluster join` on the "
             "others, then one `shardserve launch --ray-address auto` places every rank")
MULTIMODAL = "for image, audio and video input; shardserve serves text (of a multimodal checkpoint, its language model)"
SPECULATIVE = ("speculative decoding by separate flags; here --speculative-config with vLLM's JSON "
               "('{\"method\": \"ngram\", \"num_speculative_tokens\": 3}': prompt lookup, or method draft_model "
               "with model: a draft model, method eagle3 with model: an EAGLE-3 head, or method mtp: "
               "the model's own MTP layer)")
NO_LOGS = "shardserve writes no request, output or access log (/metrics counts requests by how they ended)"
