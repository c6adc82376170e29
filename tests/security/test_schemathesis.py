"""Schemathesis fuzzes the real controller (uvicorn on a free port, a real redis-server) from
its own OpenAPI document, with the admin token: every operation, every phase (examples,
coverage, fuzzing, stateful), positive and negative inputs, every check. No 5xx, and no
answer outside the documented statuses, content types and schemas.

Its engine runs in-process, as `schemathesis run` would (schemathesis' pytest plugin does not
run on this pytest). Jobs it manages to submit (the schema's example spec, and any generated
spec that also passes the semantic checks) stay Pending (no agents) and are cancelled at the
end; at least one must have been accepted, so a schema that lets no valid spec be generated
fails here.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import Status, events

from tests.stack import wait_until

MAX_EXAMPLES = 20  # per operation and phase: about a minute on 2 cores
OPEN = ("Pending", "Running", "Recovering")


def config(token: str) -> SchemathesisConfig:
    return SchemathesisConfig.from_dict(
        {
            "seed": 11,  # the same inputs on every run: a failure here reproduces
            "auth": {"openapi": {"bearer": {"bearer": token}}},
            "generation": {"max-examples": MAX_EXAMPLES, "mode": "all"},
            "operations": [
                {
                    # A spec can be schema-valid and still wrong (global_batch divisible by dp x
                    # microbatches, heads by tp, ...): the semantic checks answer 422, documented.
                    "include-name": "POST /v1/jobs",
                    # 200: a retry under an Idempotency-Key the generator used before
                    "checks": {
                        "positive_data_acceptance": {"expected-statuses": ["200", "201", "422"]}
                    },
                },
                {
                    # the same semantic checks on the spec to plan, and a cluster a spec may
                    # not fit (or no live pool to plan for): 422, documented
                    "include-name": "POST /v1/plan",
                    "checks": {"positive_data_acceptance": {"expected-statuses": ["200", "422"]}},
                },
                {
                    # The agents' join: the admin token is not the join token, so every call is
                    # a 401 (tests/security/test_api_auth.py covers it); fuzzing it would only
                    # repeat that.
                    "include-path": "/v1/agents/join",
                    "enabled": False,
                },
            ],
        }
    )


def test_schemathesis_finds_no_server_error_and_no_schema_violation(api):
    schema = schemathesis.openapi.from_url(
        api.url + "/openapi.json", config=config(api.secrets.admin_token)
    )
    failures, errors, submitted, calls = [], [], set(), 0
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            rec = event.recorder
            for interaction in rec.interactions.values():
                calls += 1
                r, req = interaction.response, interaction.request
                if (
                    req.method == "POST"
                    and req.uri.endswith("/v1/jobs")
                    and r is not None
                    and r.status_code == 201
                ):
                    submitted.add(json.loads(r.content)["id"])
            for case_id, checks in rec.checks.items():
                for check in checks:
                    if check.status == Status.FAILURE:
                        step = (
                            check.failure_info.steps[-1]
                            if check.failure_info and check.failure_info.steps
                            else None
                        )
                        failures.append(
                            f"{check.name}: "
                            f"{check.failure_info.failure.title if check.failure_info else ''}"
                            f" -- {step.curl if step else case_id}"
                        )
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(
                f"{type(event).__name__}: "
                f"{getattr(event, 'value', getattr(event, 'exception', event))}"
            )
    try:
        assert not errors, "\n".join(errors)
        assert not failures, f"{len(failures)} failed check(s):\n" + "\n".join(
            sorted(set(failures))[:30]
        )
        assert calls > 100, f"schemathesis made only {calls} calls"
        assert submitted, "no generated spec was accepted: the schema or its example is wrong"
    finally:
        with api.controller.client() as c:
            for j in c.jobs(limit=1000):
                if j.phase in OPEN:
                    c.cancel(j.id)
            wait_until(
                lambda: not [j for j in c.jobs(limit=1000) if j.phase in OPEN],
                30,
                "every job the fuzzer submitted to be cancelled",
            )
