"""The dispatch codec: rollout requests, outcomes and generations as msgpack-ready dicts, the one wire
format the controller, the rollout ranks and their agent workers all speak (controller -> rank ->
worker and back)."""

from __future__ import annotations

import dataclasses

from molt.agents.base import RolloutOutcome, RolloutRequest, SamplingParams
from molt.trace.experience import Experience
from molt.trace.generation import Generation
from molt.trace.routes import decode_routes, encode_routes


def encode_outcome(outcome: RolloutOutcome) -> dict:
    return {"type": "outcome", "rollout_id": outcome.rollout_id, "group_id": outcome.group_id,
            "failure": outcome.failure, "error": outcome.error, "ledger": outcome.ledger,
            "experiences": [e.to_dict() for e in outcome.experiences],
            "loop_lag_max_seconds": outcome.loop_lag_max_seconds}


def decode_outcome(message: dict) -> RolloutOutcome:
    return RolloutOutcome(rollout_id=message["rollout_id"], group_id=message["group_id"],
                          failure=message["failure"], error=message["error"], ledger=message["ledger"],
                          experiences=[Experience.from_dict(e) for e in message["experiences"]],
                          loop_lag_max_seconds=message.get("loop_lag_max_seconds", 0.0))


def decode_request(message: dict) -> RolloutRequest:
    fields = dict(message["request"])
    fields["sampling"] = SamplingParams(**fields["sampling"])
    return RolloutRequest(**fields)


def failed_outcome(request: dict, reason: str, error: str) -> dict:
    """The outcome message of a rollout that failed outside its runner (`request`: the wire dict)."""
    return encode_outcome(RolloutOutcome(rollout_id=request["rollout_id"], group_id=request["group_id"],
                                         experiences=[], failure=reason, error=error))


def plain_fields(record) -> dict:
    """A dataclass's fields as a dict, without asdict's deep copy (the values go straight to msgpack)."""
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}


def encode_generation(generation: Generation) -> dict:
    """A generation for msgpack (the rank answers a worker's generate call), routes as raw bytes."""
    return {**plain_fields(generation), "routed_experts": encode_routes(generation.routed_experts)}


def decode_generation(data: dict) -> Generation:
    return Generation(**{**data, "routed_experts": decode_routes(data.get("routed_experts"))})
