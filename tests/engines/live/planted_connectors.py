"""KV connectors with transport faults a live-server test plants (vLLM's ExampleConnector,
which loads synchronously in the worker's forward, with a fault switched on by the prompt):
a prompt whose first token ids are SHORT loads only its first block, one starting with
SKIP_LAST loads all but its last block; both report the load done, as a faulty transport
would. The decode server loads them with kv_connector_module_path=planted_connectors."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

SHORT = [7, 7, 7, 11]  # a prompt starting with these token ids gets only its first block
SKIP_LAST = [7, 7, 7, 13]  # ... gets every block but its last


class PlantedFaultConnector(ExampleConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        undo = []  # (kv tensor, blocks, their content before the load)
        for request in self._get_connector_metadata().requests:
            if request.is_store:
                continue
            head = request.token_ids[: len(SHORT)].tolist()
            blocks = list(dict.fromkeys((request.slot_mapping // self._block_size).tolist()))  # in order
            lost = blocks[1:] if head == SHORT else blocks[-1:] if head == SKIP_LAST else []
            for layer in forward_context.no_compile_layers.values():
                kv = getattr(layer, "kv_cache", None)
                if lost and kv is not None and kv.numel():
                    undo.append((kv, lost, kv[lost].clone()))
        super().start_load_kv(forward_context, **kwargs)
        for kv, lost, before in undo:  # the transport "lost" these blocks, and said nothing
            kv[lost] = before
