"""Step-time model of the simulated engine: pure functions of a batch's shape.

A **prefill step** holds requests i, each computing ``n_i`` new tokens on top of ``p_i``
tokens already in KV (its cached prefix plus its earlier chunks)::

    t_prefill = t0_prefill_s + sum_i [ n_i * tau_lin_s + n_i * (p_i + n_i / 2) * tau_att_s ]

``tau_lin_s`` is the GEMM cost of one token, ``tau_att_s`` the cost of one causal
query-key pair. A prefill step runs no decode work (SGLang's default
``enable_mixed_chunk=False``).

A **decode step** with ``B`` running requests whose contexts sum to ``S`` tokens::

    t_decode = decode_a_s + decode_b_s * B + decode_c_s_per_token * S

``a`` is the weight read plus launch overhead, ``c`` the KV read per context token.

**Token scale** ``k`` (``token_scale``): one simulated token stands for ``k`` real ones
(docs/simulator.md, "Token scale"). ``n``, ``p`` and ``S`` are then in simulated tokens,
the per-token cost is multiplied by ``k``, the pair cost by ``k**2``, and one decode step
stands for ``k`` real steps::

    t_prefill = t0 + sum_i [ k * tau_lin * n_i + k**2 * tau_att * n_i * (p_i + n_i / 2) ]
    t_decode  = k * (a + b * B) + k**2 * c * S

The constants stay the real (unscaled) ones, so ``to_dict()`` reports the same numbers
whatever ``k`` is.

The ``legacy`` model (``kind == "legacy"``) is the simulator's original two-constant
model: ``tau_att_s == decode_c_s_per_token == 0``; at ``k == 1`` it gives exactly the
step times it always gave (``prefill_base_s + prefill_per_token_s * tokens`` and
``decode_base_s + decode_per_req_s * B``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

COST_KINDS = ("calibrated", "legacy")


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step durations in simulated seconds. Defaults: the ``legacy`` model at k = 1."""

    t0_prefill_s: float = 0.010
    tau_lin_s: float = 0.00005
    tau_att_s: float = 0.0
    decode_a_s: float = 0.012
    decode_b_s: float = 0.0002
    decode_c_s_per_token: float = 0.0
    kind: str = "legacy"
    token_scale: int = 1
    # The preset these constants came from (informational; "custom" when hand-built).
    preset: str = "legacy"

    def __post_init__(self) -> None:
        validate_cost_model(self)

    @classmethod
    def legacy(
        cls,
        prefill_base_s: float = 0.010,
        prefill_per_token_s: float = 0.00005,
        decode_base_s: float = 0.012,
        decode_per_req_s: float = 0.0002,
        token_scale: int = 1,
    ) -> CostModel:
        """The original two-constant model under its original constant names."""
        custom = (prefill_base_s, prefill_per_token_s, decode_base_s, decode_per_req_s) != (
            0.010,
            0.00005,
            0.012,
            0.0002,
        )
        return cls(
            t0_prefill_s=prefill_base_s,
            tau_lin_s=prefill_per_token_s,
            tau_att_s=0.0,
            decode_a_s=decode_base_s,
            decode_b_s=decode_per_req_s,
            decode_c_s_per_token=0.0,
            kind="legacy",
            token_scale=token_scale,
            preset="custom" if custom else "legacy",
        )

    # Old names of the legacy constants (SimConfig users and /server_info read them).
    @property
    def prefill_base_s(self) -> float:
        return self.t0_prefill_s

    @property
    def prefill_per_token_s(self) -> float:
        return self.tau_lin_s

    @property
    def decode_base_s(self) -> float:
        return self.decode_a_s

    @property
    def decode_per_req_s(self) -> float:
        return self.decode_b_s

    # ------------------------------------------------------------------ model

    def prefill_s(self, items: Sequence[tuple[int, int]]) -> float:
        """One prefill step: ``items`` = (new tokens, tokens already in KV) per request."""
        k = self.token_scale
        n_total = 0
        pairs = 0.0
        for n, p in items:
            n_total += n
            pairs += n * (p + n / 2)
        return self.t0_prefill_s + k * self.tau_lin_s * n_total + k * k * self.tau_att_s * pairs

    def decode_s(self, batch_size: int, context_tokens: int) -> float:
        """One decode step of ``batch_size`` requests whose contexts total ``context_tokens``."""
        k = self.token_scale
        return k * (self.decode_a_s + self.decode_b_s * batch_size) + (
            k * k * self.decode_c_s_per_token * context_tokens
        )

    def prefill_tokens_s(self, tokens: int, cached: int = 0, chunk: int = 0) -> float:
        """A whole prompt of ``tokens`` new tokens after ``cached`` ones, in chunks of
        ``chunk`` tokens (0: one step), each step paying ``t0_prefill_s``."""
        if tokens <= 0:
            return 0.0
        if chunk <= 0:
            return self.prefill_s(((tokens, cached),))
        total = 0.0
        done = 0
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.prefill_s(((n, cached + done),))
            done += n
        return total

    def to_dict(self) -> dict[str, Any]:
        """Every constant with its unit in the key, the kind, preset and token scale."""
        k = self.token_scale
        return {
            "preset": self.preset,
            "kind": self.kind,
            "token_scale": k,
            "t0_prefill_s": self.t0_prefill_s,
            "tau_lin_s": self.tau_lin_s,
            "tau_att_s": self.tau_att_s,
            "decode_a_s": self.decode_a_s,
            "decode_b_s": self.decode_b_s,
            "decode_c_s_per_token": self.decode_c_s_per_token,
            # What one simulated token / step costs at this token scale.
            "scaled_tau_lin_s_per_sim_token": k * self.tau_lin_s,
            "scaled_tau_att_s_per_sim_pair": k * k * self.tau_att_s,
            "scaled_decode_a_s": k * self.decode_a_s,
            "scaled_decode_b_s": k * self.decode_b_s,
            "scaled_decode_c_s_per_sim_token": k * k * self.decode_c_s_per_token,
        }


def validate_cost_model(c: CostModel) -> None:
    if c.kind not in COST_KINDS:
        raise ValueError(f"cost model kind must be one of {COST_KINDS}, got {c.kind!r}")
    if isinstance(c.token_scale, bool) or not isinstance(c.token_scale, int) or c.token_scale < 1:
        raise ValueError(f"token_scale must be an integer >= 1, got {c.token_scale!r}")
    values = (
        c.t0_prefill_s,
        c.tau_lin_s,
        c.tau_att_s,
        c.decode_a_s,
        c.decode_b_s,
        c.decode_c_s_per_token,
    )
    if not all(v >= 0 for v in values):  # also rejects NaN
        raise ValueError("cost-model constants must be >= 0")
    if c.t0_prefill_s + c.decode_a_s <= 0:
        raise ValueError("t0_prefill_s + decode_a_s must be > 0 (a step must take simulated time)")
