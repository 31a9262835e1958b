"""What leaves vLLM's engine core about the requests kvguard stopped: they are taken out of the
step's SchedulerOutput before the workers run it (`strip`), and each one's client is sent its
end in kvguard's words (`tell`).

Invariant: a stopped request appears in no SchedulerOutput after its stop, and its client gets
exactly one end, vLLM's own FinishReason.ERROR with kvguard's words as its stop_reason
(frontend.py makes it the HTTP error the client reads).
"""

from __future__ import annotations

from typing import Any


def strip(out: Any, kills: set[str]) -> None:
    """Take killed requests out of a SchedulerOutput, so the workers never run them."""
    for rid in kills:
        out.total_num_scheduled_tokens -= out.num_scheduled_tokens.pop(rid, 0)
        out.scheduled_spec_decode_tokens.pop(rid, None)
        out.scheduled_encoder_inputs.pop(rid, None)
    out.scheduled_new_reqs = [r for r in out.scheduled_new_reqs if r.req_id not in kills]
    cached = out.scheduled_cached_reqs
    keep = [i for i, rid in enumerate(cached.req_ids) if rid not in kills]
    if len(keep) != len(cached.req_ids):
        n = len(cached.req_ids)
        for name, value in list(vars(cached).items()):
            if isinstance(value, list) and len(value) == n:
                setattr(cached, name, [value[i] for i in keep])
        cached.resumed_req_ids = cached.resumed_req_ids - kills
        for rid in kills:
            cached.all_token_ids.pop(rid, None)


def tell(result: dict[int, Any], told: list[tuple[int, str, str]]) -> dict[int, Any]:
    """update_from_output's result, with each (client, request, why) of `told` ended for its
    client: vLLM's FinishReason.ERROR with kvguard's words."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    for client, rid, reason in told:
        end = EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
        outputs = result.get(client)
        if outputs is None:
            result[client] = EngineCoreOutputs(outputs=[end])
        else:
            outputs.outputs = [*outputs.outputs, end]
    return result
