"""Turn new token ids into text, find stop strings, and assemble RequestOutputs.

Text that could still turn out to be the start of a stop string is held back from the visible
output until the next tokens show it is not, so a streaming client never sees a stop string it
should not (or half of one). A stop string found is reported to the engine, which has the
scheduler end the request there: this module never changes a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.loader.detokenizer import IncrementalDetokenizer
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.request import Request
from tokenmill.sampling.sampler import TokenLogprobs


@dataclass(frozen=True)
class StopStringHit:
    """Output token `num_output_tokens` (counting from 1) completed stop string `stop`."""

    request: Request
    stop: str
    num_output_tokens: int


@dataclass
class SequenceState:
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    num_processed_tokens: int = 0

    @property
    def visible_text(self) -> str:
        if self.request.is_finished:
            return self.text
        hold = max((len(s) for s in self.request.params.stop), default=1) - 1
        return self.text[: len(self.text) - hold] if hold else self.text

    def completion(self) -> CompletionOutput:
        request = self.request
        return CompletionOutput(
            index=self.index,
            text=self.visible_text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=None if request.finish_reason is None else str(request.finish_reason),
            stop_reason=request.stop_reason,
        )


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    sequences: list[SequenceState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(seq.request.is_finished for seq in self.sequences)

    def output(self) -> RequestOutput:
        first = self.sequences[0].request
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[seq.completion() for seq in self.sequences],
            finished=self.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=first.metrics,
            prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
            num_disk_cached_tokens=first.num_disk_cached_tokens,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, ParentState] = {}
        self._sequences: dict[str, tuple[ParentState, SequenceState]] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        parent = ParentState(request_id, prompt, list(children[0].prompt_token_ids))
        if children[0].params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for index, child in enumerate(children):
            seq = SequenceState(
                request=child,
                index=index,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, child.params.skip_special_tokens
                ),
                logprobs=[] if child.params.logprobs is not None else None,
            )
            parent.sequences.append(seq)
            self._sequences[child.request_id] = (parent, seq)
        self._parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [] if parent is None else [seq.request.request_id for seq in parent.sequences]

    def add_prompt_logprobs(self, prompt_logprobs: dict[str, list[TokenLogprobs]]) -> None:
        """Append a step's prompt-token logprobs; they arrive chunk by chunk, in order."""
        for request_id, entries in prompt_logprobs.items():
            parent, _ = self._sequences[request_id]
            if parent.prompt_logprobs is not None:
                parent.prompt_logprobs += entries

    def update_text(
        self, progressed: list[Request], logprobs: dict[str, list[TokenLogprobs]]
    ) -> list[StopStringHit]:
        """Detokenize new tokens; returns the stop strings found, one per request at most.

        A step may bring several tokens (accepted drafts). With stop strings they are added one
        at a time, and the hit names the token completing the stop string: the tokens after it
        are to be dropped, so the output equals what one token per step would have given."""
        hits = []
        for request in progressed:
            _, seq = self._sequences[request.request_id]
            new_ids = request.output_token_ids[seq.num_processed_tokens :]
            one_by_one = bool(request.params.stop) and len(new_ids) > 1
            groups = [[token] for token in new_ids] if one_by_one else [new_ids]
            num_kept = len(new_ids)
            for index, group in enumerate(groups):
                searched_from = len(seq.text)
                seq.text += seq.detokenizer.add_tokens(group)
                if index == len(groups) - 1 and request.is_finished:
                    seq.text += seq.detokenizer.flush()
                    break
                stop = self._find_stop(seq, searched_from)
                if stop is not None:
                    num_kept = index + 1 if one_by_one else len(new_ids)
                    hits.append(StopStringHit(request, stop, seq.num_processed_tokens + num_kept))
                    break
            seq.num_processed_tokens += num_kept
            entries = logprobs.get(request.request_id, [])[:num_kept]
            if seq.logprobs is not None:
                seq.logprobs += entries
                seq.cumulative_logprob += sum(entry.logprob for entry in entries)
        return hits

    def outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per parent among `requests`; finished parents are forgotten."""
        parents: dict[str, ParentState] = {}
        for request in requests:
            parent, _ = self._sequences[request.request_id]
            parents[parent.request_id] = parent
        results = [parent.output() for parent in parents.values()]
        for parent in parents.values():
            if parent.finished:
                self.drop(parent.request_id)
        return results

    def drop(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is not None:
            for seq in parent.sequences:
                self._sequences.pop(seq.request.request_id, None)

    @staticmethod
    def _find_stop(seq: SequenceState, searched_from: int) -> str | None:
        """Cut the text at the earliest stop string that the new text completed."""
        params = seq.request.params
        best: tuple[int, str] | None = None
        for stop in params.stop:
            at = seq.text.find(stop, max(0, searched_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        seq.text = (
            seq.text[: at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
        )
        return stop
