"""The word sets that a config field takes and the objectives' functions take as an argument
(algorithm.loss_aggregation, importance_level, importance_mode, kl_estimator): defined here once,
because config and objectives are both lower floors and neither may import the other. A leaf:
it imports nothing of Molt."""

from typing import Literal

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "constant"]
ImportanceLevel = Literal["token", "seq", "geo"]  # the config adds "off": no correction, no weights computed
ImportanceMode = Literal["mask", "clip", "trunc"]
KLEstimator = Literal["k1", "k2", "k3"]
