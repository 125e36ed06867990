"""Payload delivery (DESIGN section 7): a store per node for experiences' heavy tensors, and one
reference type that reloads them from shared memory or a spill file on the node, or over ZeroMQ
from any other node.

    store = PayloadStore("node0", budget_bytes=..., spill_dir=...)   # producing side
    ref = store.offload({"token_ids": ..., "image": ...})            # ref.to_dict() -> the record
    client = PayloadClient("node1")                                  # consuming side
    tensors = client.reload(PayloadRef.from_dict(record))            # then freed at the owner
"""

from molt.transport.payloads.client import PayloadClient
from molt.transport.payloads.fields import (TOKEN_FIELDS, experience_tensors, offload_experience, offload_record,
                                            reload_record, restore_experience)
from molt.transport.payloads.reference import PayloadRef, TensorEntry, default_node_id
from molt.transport.payloads.store import PayloadStore

__all__ = ["PayloadClient", "PayloadRef", "PayloadStore", "TOKEN_FIELDS", "TensorEntry", "default_node_id",
           "experience_tensors", "offload_experience", "offload_record", "reload_record", "restore_experience"]
