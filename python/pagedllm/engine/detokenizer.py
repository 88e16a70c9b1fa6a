"""Incremental detokenization with stop strings, one `IncrementalDetokenizer` per sequence.

Works with any tokenizer exposing `decode(ids, skip_special_tokens=...)`. Each `append` decodes
only a short window of recent tokens, so the cost per token does not grow with the sequence.

Text is held back in two cases and released by later tokens or by `finish()`:
- trailing U+FFFD: an incomplete multi-byte UTF-8 character (or a run of byte tokens) that the
  next token may complete; a U+FFFD followed by other text is final and is emitted;
- with stop strings, the last `max(len(stop)) - 1` characters, which may be the start of a stop
  string, so that streamed text is never taken back.

The streamed text is the decoding of the generated tokens: they are decoded after a few prompt
tokens (tokenizers decode a token differently at the start of a text), cut to end on a whole
character, so a prompt's last character (a U+FFFD, or a token-id prompt ending inside a UTF-8
character) is never part of the output, nor completed by it. For valid UTF-8 this is
`decode(prompt + output)` minus the prompt's text, and for byte-level decoders (raw bytes, GPT-2
ByteLevel) `decode(output)` for invalid bytes too. Decoders that decode
a whole run of byte tokens at once (SentencePiece byte fallback) may turn characters already
streamed into U+FFFD when an invalid byte follows them; streamed text cannot be taken back, so on
such invalid output the U+FFFDs may differ from a full decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedllm.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded before the first generated one: tokenizers decode a token differently
# at the start of a text (SentencePiece drops the leading space).
CONTEXT_TOKENS = 4
# A prompt's trailing tokens that may be dropped so that the context ends on a whole character
# (a UTF-8 character spans at most 4 byte tokens).
MAX_PARTIAL_TOKENS = 4
# Once the window holds this many tokens it slides forward to a clean boundary.
MAX_WINDOW_TOKENS = 16
# Without a clean boundary (a long run of invalid bytes) it slides anyway at this size.
HARD_WINDOW_TOKENS = 4 * MAX_WINDOW_TOKENS


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def _stable_length(text: str) -> tuple[int, int]:
    """(length without the trailing U+FFFD run, length of that run)."""
    stable = len(text.rstrip(REPLACEMENT_CHAR))
    return stable, len(text) - stable


class _TokenWindow:
    """Turns a token stream into a text stream by decoding a bounded window of recent tokens.

    Invariant: `emitted` characters of decode(window) have been handed out; only the text past
    them (minus a trailing U+FFFD run) is new. A *clean boundary* is a window position after
    which the decoded text did not end in U+FFFD: no character is split there, so the window can
    restart at it and decode the rest exactly as the full sequence would.
    """

    def __init__(self, decoder: Decoder, context_ids: Sequence[int], skip_special_tokens: bool):
        self._decoder = decoder
        self._skip = skip_special_tokens
        self._ids = self._whole_characters(context_ids)
        self._ids = self._ids[self._first_whole_character() :]
        # the context's text is the prompt's: none of it is output
        self._emitted = len(self._decode())
        self._clean: list[int] = [0]  # clean boundaries, at most the last two

    def _decode(self) -> str:
        return self._decoder.decode(self._ids, skip_special_tokens=self._skip)

    def _whole_characters(self, context_ids: Sequence[int]) -> list[int]:
        """The last CONTEXT_TOKENS prompt tokens before its trailing U+FFFD run (an incomplete
        character, or a U+FFFD typed in the prompt): output bytes after it decode on their own,
        as the output's, instead of completing (or following) a character of the prompt."""
        ids = list(context_ids[-(CONTEXT_TOKENS + MAX_PARTIAL_TOKENS) :])
        while ids and self._decoder.decode(ids, skip_special_tokens=self._skip).endswith(
            REPLACEMENT_CHAR
        ):
            ids.pop()
        return ids[-CONTEXT_TOKENS:]

    def _first_whole_character(self) -> int:
        """Skip leading context tokens that continue a character begun before the context."""
        for start in range(len(self._ids)):
            text = self._decoder.decode(self._ids[start:], skip_special_tokens=self._skip)
            if not text.startswith(REPLACEMENT_CHAR):
                return start
        return 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final."""
        self._ids.append(token_id)
        text = self._decode()
        stable, held = _stable_length(text)
        delta = text[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if held == 0:
            self._clean = [self._clean[-1], len(self._ids)]
            if len(self._ids) >= MAX_WINDOW_TOKENS and self._clean[0] > 0:
                self._slide_to(self._clean[0])
        elif len(self._ids) >= HARD_WINDOW_TOKENS:
            delta += self._slide_blind(held)
        return delta

    def _slide_to(self, boundary: int) -> None:
        """Restart at the clean boundary before the last chunk, which stays as context. Only
        called when all text is emitted: some decoders (byte fallback) turn text already emitted
        into U+FFFD while a character is incomplete, so only then is the count exact."""
        self._ids = self._ids[boundary:]
        self._clean = [p - boundary for p in self._clean]
        self._emitted = len(self._decode())

    def _slide_blind(self, held: int) -> str:
        """No clean boundary in a whole window (a run of invalid bytes): restart near the end,
        at a cut that decodes the same in two parts as in one, so U+FFFDs are neither added nor
        lost. The text before the cut is final: return what of it was held."""
        for cut in range(len(self._ids) - CONTEXT_TOKENS, len(self._ids) - 4 * CONTEXT_TOKENS, -1):
            before = self._decoder.decode(self._ids[:cut], skip_special_tokens=self._skip)
            after = self._decoder.decode(self._ids[cut:], skip_special_tokens=self._skip)
            if before + after == self._decode():
                self._ids = self._ids[cut:]
                self._clean = [0]
                delta = before[self._emitted :]
                self._emitted = max(0, self._emitted - len(before))
                return delta
        return self._slide_approximately(held)

    def _slide_approximately(self, held: int) -> str:
        """Keep the last CONTEXT_TOKENS tokens. If the cut splits a character, its orphan bytes
        decode to U+FFFD just before the held run; the shorter run is the one still held."""
        self._ids = self._ids[-CONTEXT_TOKENS:]
        self._clean = [0]
        text = self._decode()
        still_held = min(held, _stable_length(text)[1])
        self._emitted = len(text) - still_held
        return REPLACEMENT_CHAR * (held - still_held)

    def flush(self) -> str:
        """The held trailing U+FFFD run, final now that no token follows."""
        text = self._decode()
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta


def _find_stop(text: str, new_from: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """Earliest stop string in `text` that ends at or after `new_from` (a match that ended
    earlier was already checked, or fell before min_tokens)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, new_from - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


class IncrementalDetokenizer:
    """Text and stop-string state of one generated sequence.

    `append(token_id) -> (delta, stop)`: `delta` is new final text, `stop` the stop string that
    matched (the sequence is then finished: text is cut before it, or just after it with
    `include_stop_str_in_output`). Call `finish()` when the sequence ends for another reason to
    get the held-back tail. `text` is everything released so far.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._window = _TokenWindow(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stops = list(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""  # decoded but not released (may start a stop string)
        self.text = ""
        self.num_tokens = 0
        self.stop_reason: str | None = None

    @classmethod
    def from_params(
        cls, tokenizer: Decoder, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_id: int) -> tuple[str, str | None]:
        if self.finished:
            raise RuntimeError(f"sequence already stopped by {self.stop_reason!r}")
        self.num_tokens += 1
        new_text = self._window.push(token_id)
        if not new_text:
            return "", None
        checked = len(self._pending)
        self._pending += new_text
        # vLLM: a stop string counts only once more than min_tokens tokens exist.
        if self._stops and self.num_tokens > self._min_tokens:
            match = _find_stop(self._pending, checked, self._stops)
            if match is not None:
                return self._stop_at(*match), match[1]
        return self._release(len(self._pending) - self._hold), None

    def _stop_at(self, at: int, stop: str) -> str:
        self.stop_reason = stop
        self._pending = self._pending[: at + len(stop) if self._include_stop else at]
        return self._release(len(self._pending))

    def _release(self, upto: int) -> str:
        if upto <= 0:
            return ""
        delta, self._pending = self._pending[:upto], self._pending[upto:]
        self.text += delta
        return delta

    def finish(self) -> str:
        """Release everything held back (the sequence ended). Idempotent."""
        if not self.finished:
            self._pending += self._window.flush()
        return self._release(len(self._pending))
