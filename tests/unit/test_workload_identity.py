"""W3's subagent identity conventions on the wire (docs/adoption.md): own ids, own ids
naming their lead as parent, one id shared with the lead."""

from __future__ import annotations

import pytest

from kvlab.workload.model import WorkloadError
from kvlab.workload.plan import SUBAGENT_INFIX, is_subagent_id
from kvlab.workload.spec import workload_spec
from kvlab.workload.wire import identity_headers, lead_of, wire_identity

LEAD = "subagents-0-00003"
SUB = f"{LEAD}{SUBAGENT_INFIX}2.1"


@pytest.mark.parametrize(
    ("sid", "convention", "expected"),
    [
        (SUB, "own", (SUB, None)),
        (SUB, "parent", (SUB, LEAD)),
        (SUB, "shared", (LEAD, None)),
        (LEAD, "own", (LEAD, None)),
        (LEAD, "parent", (LEAD, None)),
        (LEAD, "shared", (LEAD, None)),
    ],
)
def test_wire_identity(sid: str, convention: str, expected: tuple[str, str | None]) -> None:
    assert wire_identity(sid, convention) == expected


def test_headers_and_lead() -> None:
    assert is_subagent_id(SUB) and lead_of(SUB) == LEAD and lead_of(LEAD) is None
    assert identity_headers(SUB, "parent") == {"X-Session-ID": SUB, "X-Parent-Session-ID": LEAD}
    assert identity_headers(SUB, "shared") == {"X-Session-ID": LEAD}


def test_the_convention_is_a_workload_setting() -> None:
    assert workload_spec("subagents").subagent_identity == "own"
    assert workload_spec("subagents", subagent_identity="shared").subagent_identity == "shared"
    with pytest.raises(WorkloadError, match="subagent_identity must be one of"):
        workload_spec("subagents", subagent_identity="tree")
