"""The offline API: `LLM(model=...).generate(prompts, params)` runs a batch to completion;
`LLM.chat` renders conversations first, with tools as the server takes them."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.structured.tools import ToolPlan, chat_template_input, plan_tools

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = EngineArgs.model, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def close(self) -> None:
        """Write the prefix cache's blocks the disk tier lacks (if there is one); the engine
        then runs without it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A single prompt may be a str, a dict or a list of
        token ids; a list of str, dicts or id lists is a batch."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(batch), "sampling_params")
        priorities = _per_prompt(priority or 0, len(batch), "priority")
        self._compile_grammars(params)
        ids = [str(next(self._ids)) for _ in batch]
        try:
            for request_id, prompt, p, prio in zip(ids, batch, params, priorities, strict=True):
                self.engine.add_request(request_id, prompt, p, priority=prio)
        except ValueError:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate.

        `tools` and `tool_choice` are OpenAI's (structured/tools.py, as the server): with
        `"required"` or a named function the output is constrained to a call; a finished
        output's calls are parsed into `CompletionOutput.tool_calls`, with finish_reason
        "tool_calls". Messages may carry OpenAI's `tool_calls` and `tool` results."""
        plan = plan_tools(tools, tool_choice)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            rendered, template_tools = chat_template_input(
                conversation, plan, self.tokenizer.chat_template
            )
            text = self.tokenizer.apply_chat_template(
                rendered, add_generation_prompt, tools=template_tools
            )
            prompts.append(
                {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
            )
        if plan is not None and plan.constraint is not None:
            sampling_params = _constrained(sampling_params, plan.constraint, len(prompts))
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        if plan is not None:
            _parse_tool_calls(outputs, plan)
        return outputs

    def _compile_grammars(self, params: Sequence[SamplingParams]) -> None:
        """Compile every structured-output constraint of the batch (in parallel, each distinct
        one once) before any request starts; a constraint that does not compile raises
        ValueError naming the field."""
        specs = [p.structured_outputs for p in params if p.structured_outputs is not None]
        for grammar in [self.engine.structured.compile(spec) for spec in specs]:
            grammar.result()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in ids]


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count


def _constrained(
    params: SamplingParams | Sequence[SamplingParams] | None,
    constraint: StructuredOutputsParams,
    count: int,
) -> list[SamplingParams]:
    """Each prompt's params with the tool call's constraint (which no other may replace)."""
    result = []
    for p in _per_prompt(params or SamplingParams(), count, "sampling_params"):
        if p.structured_outputs is not None:
            raise ValueError(
                "tool_choice required or named cannot be combined with structured_outputs"
            )
        result.append(dataclasses.replace(p, structured_outputs=constraint))
    return result


def _parse_tool_calls(outputs: list[RequestOutput], plan: ToolPlan) -> None:
    for output in outputs:
        for completion in output.outputs:
            if completion.finish_reason != "stop":
                continue  # cut off: its text is passed on as it is
            completion.tool_calls = plan.parse(completion.text)
            if completion.tool_calls is not None:
                completion.finish_reason = "tool_calls"
