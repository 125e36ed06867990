"""The class vLLM mixes into each engine worker (`worker_extension_cls`, set by refit.receiver_cls):
the refit receiver (molt.refit.receiver) and MoE route capture (molt.rollout.route_capture) in one,
since vLLM takes a single extension class. A receiver_cls of your own derives from WorkerExtension
to keep both."""

from molt.refit.receiver import RefitReceiver
from molt.rollout.route_capture import RouteCapture


class WorkerExtension(RefitReceiver, RouteCapture):
    """Molt's methods on a vLLM worker: `molt_*` refit calls and route capture, through collective_rpc."""
