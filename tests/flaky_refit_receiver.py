"""A refit receiver that fails chosen refit versions once each, for the refit-failure tests.

MOLT_TEST_REFIT_FAULTS='2:raise,3:hang,4:stall' = the first attempt at version 2 fails its load
part-way (vLLM gets the first bucket's weights, the rest is received and dropped, then it raises);
the first at version 3 sleeps MOLT_TEST_REFIT_HANG_SECONDS after receiving everything, before the
load completes (an engine slower than refit.timeout_seconds); the first at version 4 sleeps that
long before it is ready to receive (an engine that does not acknowledge the pause in time). Later
attempts at those versions load normally. Each worker process of an engine fails alike.
vLLM imports this class into its worker processes (refit.receiver_cls), so its module must be on
their PYTHONPATH.
"""

import os
import time

from molt.rollout.worker_extension import WorkerExtension

FAULTS = dict(item.split(":") for item in os.environ.get("MOLT_TEST_REFIT_FAULTS", "").split(",") if item)


def _sleep() -> None:
    time.sleep(float(os.environ["MOLT_TEST_REFIT_HANG_SECONDS"]))


class FlakyRefitReceiver(WorkerExtension):
    def molt_prepare_refit(self, version: int) -> None:
        if FAULTS.get(str(version)) == "stall":
            del FAULTS[str(version)]
            _sleep()
        super().molt_prepare_refit(version)

    def molt_receive_weights(self, version: int) -> None:
        fault = FAULTS.pop(str(version), None)
        weights = self.molt_stream_weights()
        if fault == "raise":
            weights = self._first_bucket_then_fail(weights, version)
        elif fault == "hang":
            weights = self._then_sleep(weights)
        self.molt_load_weights(weights)

    def _first_bucket_then_fail(self, weights, version: int):
        first_bucket = len(self._molt_plan[0])
        for index, weight in enumerate(weights):  # every bucket is received: the trainer's sends all complete
            if index < first_bucket:
                yield weight
        raise RuntimeError(f"injected load failure at version {version}")

    def _then_sleep(self, weights):
        yield from weights
        _sleep()
