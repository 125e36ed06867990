"""A refit receiver that fails chosen refit versions once each, for the refit-failure tests.

MOLT_TEST_REFIT_FAULTS='2:raise,3:hang' = the first attempt at version 2 raises after receiving the
weights (a failed load); the first at version 3 sleeps MOLT_TEST_REFIT_HANG_SECONDS before loading
(an engine slower than refit.timeout_seconds). Later attempts at those versions load normally.
vLLM imports this class into its worker processes (refit.receiver_cls), so its module must be on
their PYTHONPATH.
"""

import os
import time

from molt.refit_receiver import RefitReceiver

FAULTS = dict(item.split(":") for item in os.environ.get("MOLT_TEST_REFIT_FAULTS", "").split(",") if item)


class FlakyRefitReceiver(RefitReceiver):
    def molt_receive_weights(self, version: int) -> None:
        weights = self.molt_receive_buckets()
        fault = FAULTS.pop(str(version), None)
        if fault == "raise":
            raise RuntimeError(f"injected load failure at version {version}")
        if fault == "hang":
            time.sleep(float(os.environ["MOLT_TEST_REFIT_HANG_SECONDS"]))
        self.molt_load_weights(weights)
