"""What one simulated rank accepts of a new request, and how long its output will be.

Pure. :func:`check_input` raises :class:`~kvlab.sim.records.SimError` for what SGLang
rejects about a request's size; :func:`plan_output` fixes the output length and stop
token in advance (the simulated model's output is a deterministic stream).
"""

from __future__ import annotations

from kvlab.sim.config import SchedulerConfig
from kvlab.sim.records import SimError, SimRequest
from kvlab.sim.tokenizer import EOS_TOKEN_ID, OutputStream, rid_seed


def check_input(cfg: SchedulerConfig, req: SimRequest, n_in: int) -> None:
    """What SGLang rejects about a request's size (raises :class:`SimError`)."""
    if n_in == 0:
        raise SimError("The input is empty.")
    if n_in >= cfg.context_length:
        raise SimError(
            f"The input ({n_in} tokens) is longer than the model's context length "
            f"({cfg.context_length} tokens)."
        )
    if n_in + 1 > cfg.max_total_tokens:
        raise SimError(
            f"The input ({n_in} tokens) does not fit in the KV cache "
            f"(max_total_num_tokens={cfg.max_total_tokens})."
        )
    if req.max_new_tokens < 0:
        raise SimError("max_new_tokens must be at least 0")


def plan_output(
    cfg: SchedulerConfig,
    req: SimRequest,
    output_len: int | None,
    stop_token_ids: tuple[int, ...],
    ignore_eos: bool,
) -> None:
    """Output length: max_new_tokens unless the workload asks for another one."""
    stop_token = stop_token_ids[0] if stop_token_ids else EOS_TOKEN_ID
    target = req.max_new_tokens
    if output_len is not None:
        target = max(0, min(int(output_len), req.max_new_tokens))
    elif cfg.output_len_dist == "uniform" and not ignore_eos and req.max_new_tokens > 0:
        target = 1 + rid_seed(req.rid) % req.max_new_tokens
    by_stop = 0 < target < req.max_new_tokens
    req.target_len = target
    req.stop_token = stop_token if by_stop else None
    req.out = OutputStream(req.rid, target if by_stop else None, stop_token)
