"""Chat-template delta tokenization: the token ids of *new* environment messages, to append to a
trajectory's exact ids (token-in/token-out: the policy's own tokens are never re-tokenized).

Why deltas: decoding the sampled ids and re-tokenizing the whole conversation does not round-trip
(merges across turn boundaries, whitespace, special tokens), so the trainer would score tokens
the policy never sampled. Instead, after an assistant turn A that ended with its end-of-turn token:

    new  = render(history + [A] + new_messages, add_generation_prompt=True)
    base = render(history + [A])
    delta_text = new[len(base):]                       # when base is a prefix of new
    env_ids = encode(tail + delta_text)

`tail` is what the template writes after an assistant message's content that the policy did not
sample: the template's assistant suffix (e.g. "<|im_end|>\\n") minus the end-of-turn token the
policy generated ("\\n"), or the whole suffix when the turn ended without it.

Some templates render history differently once later messages exist: Qwen3 drops an earlier
assistant turn's `<think>` block (an empty one once any message follows, a non-empty one once a
new user query follows). Then base is not a prefix of new, and A's content as the policy wrote it
is not in new either, so neither can anchor the delta. The fallback (counted as
`delta_fallbacks`) finds where A's rendering ends without reading A: it renders new once more
with the first new message's content replaced by a probe, and the delta starts after the last
assistant suffix before the probe; new must match that rendering up to there. Either way only
template and environment text is appended: the policy's ids stay as sampled, and what the
template rewrote in the history is the drift `check_drift` reports (it compares a whole trajectory
with a full re-tokenization, verl's tokenization_sanity_check_mode, and only reports).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from services.common.errors import FailedPrecondition, InvalidArgument

SanityMode = Literal["disable", "strict", "ignore_strippable"]
_PROBE = "\x00meshrl-probe\x00"
_PROBE_A = "\x00meshrl-probe-assistant\x00"
_WS = re.compile(r"\s+")


class ChatRenderer:
    """Renders and tokenizes one trajectory's messages with the tokenizer's chat template (and the
    tools the environment offers, which templates render into the system prompt)."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidArgument("actor_rollout_ref.model.tokenizer_path",
                                  "multi-turn needs a tokenizer with a chat template")
        self.tok = tokenizer
        self.tools = [dict(t) for t in tools] or None
        self.assistant_suffix = self._assistant_suffix()
        # The suffix's first token, as text: what the policy wrote when it ended its turn itself.
        head = self.encode(self.assistant_suffix)[:1]
        self._suffix_head = str(tokenizer.decode(head, skip_special_tokens=False)) if head else ""
        self.delta_fallbacks = 0
        self._joints: dict[str, str | None] = {}

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        return str(self.tok.apply_chat_template(
            [dict(m) for m in messages], tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        ))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def _assistant_suffix(self) -> str:
        text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}], add_generation_prompt=False)
        at = text.rfind(_PROBE)
        return "" if at < 0 else text[at + len(_PROBE) :]

    def tail(self, generated_end: str) -> str:
        """What closes an assistant turn whose sampled text ends with `generated_end` (the decoded
        last token, special tokens kept): the template's suffix minus what the policy already wrote."""
        suffix = self.assistant_suffix
        # Compared as the suffix's first token: a plain token that only begins its text (a turn cut
        # right after "<") did not end the turn.
        if generated_end and generated_end == self._suffix_head and suffix.startswith(generated_end):
            return suffix[len(generated_end) :]
        return suffix

    def env_text(self, history: Sequence[Mapping[str, Any]], assistant: Mapping[str, Any],
                 new_messages: Sequence[Mapping[str, Any]], generated_end: str) -> str:
        """The text to append after an assistant turn: its tail, the new messages, and the next
        generation prompt (see the module docstring)."""
        before = [*history, assistant]
        new = self.render([*before, *new_messages], add_generation_prompt=True)
        base = self.render(before, add_generation_prompt=False)
        if new.startswith(base):
            delta = new[len(base) :]
        else:
            self.delta_fallbacks += 1
            delta = new[self._turn_end(history, assistant, new_messages, new) :]
        return self.tail(generated_end) + delta

    def _turn_end(self, history: Sequence[Mapping[str, Any]], assistant: Mapping[str, Any],
                  new_messages: Sequence[Mapping[str, Any]], new: str) -> int:
        """Where the assistant turn's rendering (its suffix included) ends in `new`, found without
        reading its content, which the template may have rewritten (see the module docstring)."""
        if new_messages:
            first = new_messages[0]
            joint = self._joint(str(first.get("role", "")))
            # The probe goes inside the message's own content, not in its place: a template may
            # read the content (Qwen3 takes a user message wrapped in <tool_response> for a tool
            # answer, not a new query), and the probed history must render as the real one.
            content = str(first.get("content") or "")
            head = content[: len(content) // 2]
            probe = head + _PROBE + content[len(head):]
            probed = self.render([*history, assistant, {**first, "content": probe}, *new_messages[1:]],
                                 add_generation_prompt=True)
            # The suffix is found with the next message's header after it, not alone: a suffix
            # as plain as "\n" also ends the header, and the delta would lose the header's text.
            at = probed.rfind(joint + head + _PROBE) if joint is not None else -1
            end = at + len(self.assistant_suffix)
            if at >= 0 and new.startswith(probed[:end]):  # else the probe changed how the history renders
                return end
        # Not InvalidArgument (the replica's own bad input, which stops it): the group fails, and the
        # coordinator halts the run with this reason on a series of them.
        raise FailedPrecondition(
            "chat template: cannot find where the assistant turn ends in the rendered conversation (the template "
            "rewrites it and writes no recognisable suffix after it); set "
            "actor_rollout_ref.rollout.multi_turn.enable=false or use a ChatML-style template"
        )

    def _joint(self, role: str) -> str | None:
        """What the template writes between an assistant message's content and the content of a
        `role` message after it (the assistant suffix, then that message's header); None when it
        does not begin with a non-empty assistant suffix."""
        if role not in self._joints:
            text = self.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE_A},
                                {"role": role, "content": _PROBE}], add_generation_prompt=True)
            a, b = text.find(_PROBE_A), text.find(_PROBE)
            joint = text[a + len(_PROBE_A) : b] if 0 <= a < b else ""
            ok = bool(self.assistant_suffix) and joint.startswith(self.assistant_suffix)
            self._joints[role] = joint if ok else None
        return self._joints[role]

    def env_ids(self, history: Sequence[Mapping[str, Any]], assistant: Mapping[str, Any],
                new_messages: Sequence[Mapping[str, Any]], generated_end: str) -> list[int]:
        return self.encode(self.env_text(history, assistant, new_messages, generated_end))

    def check_drift(self, ids: Sequence[int], messages: Sequence[Mapping[str, Any]], *, ended_on_assistant: bool,
                    generated_end: str, mode: SanityMode) -> bool:
        """True when the incrementally built `ids` (prompt + trajectory) differ from a full
        re-tokenization of `messages` under `mode` (never for `disable`)."""
        if mode == "disable":
            return False
        got = list(ids)
        if ended_on_assistant:
            got += self.encode(self.tail(generated_end))
        expected = self.encode(self.render(messages, add_generation_prompt=not ended_on_assistant))
        if mode == "strict":
            return got != expected
        strip = lambda x: _WS.sub("", str(self.tok.decode(x, skip_special_tokens=False)))  # noqa: E731
        return strip(got) != strip(expected)
