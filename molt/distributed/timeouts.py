"""The trainer group's collective timeout: how long trainer ranks 1.. may sit in one collective while
rank 0 waits on engines or rollouts."""

from __future__ import annotations

from dataclasses import dataclass

from molt.config import MoltConfig, engine_start_limit_seconds


TRAINER_HELLO_SECONDS = 120  # how long the controller waits for the other trainer ranks' hellos


TIMEOUT_MARGIN_SECONDS = 600


@dataclass(frozen=True)
class TrainerGroupTimeout:
    """The trainer group's collective timeout (NCCL's watchdog, gloo's per-operation limit) and its
    parts, in seconds: the longest trainer ranks 1.. may sit in one trainer-group collective while
    rank 0 waits on engines or rollouts (molt.trainer.loop, molt.controller.pool). Torch's 30-minute default
    is shorter than one refit timeout of the large recipes."""

    engine_start_seconds: float
    """At start ranks 1.. go straight into the first refit check's forward pass (or, resuming, the
    refit's gathers) while rank 0 waits for their hellos (120 s) and every engine
    (rollout.engine_start_timeout_seconds), then builds the refit group (in refit_seconds)."""
    refit_seconds: float
    """Ranks 1.. wait in the refit's gathers and in RefitFollower.agree while rank 0 sends to and
    waits for the engines: refit.max_attempts attempts of refit.timeout_seconds, a refit-group build
    before each (its rendezvous and the engines' join confirmations, refit.timeout_seconds each), and
    the refit check's scoring on the engines (refit.timeout_seconds, when refit.check_every_steps)."""
    batch_seconds: float
    """Rank 0's wait for the next rollout outcome (agent.rollout_timeout_seconds x 2 + 60, the
    controller's limit for a silent rank) and one payload fetch for its own share
    (payloads.fetch_timeout_seconds). Today ranks 1.. wait for their share on their controller
    socket, outside any collective, and only the fetch overlaps their first all-reduce of the step;
    the rollout term keeps the limit right if the batch moves into a collective."""
    margin_seconds: float = TIMEOUT_MARGIN_SECONDS

    @property
    def total_seconds(self) -> float:
        return self.engine_start_seconds + self.refit_seconds + self.batch_seconds + self.margin_seconds

    def describe(self, cfg: MoltConfig) -> str:
        """The dry run's line: the total and each part with the fields it comes from."""
        refit, total = cfg.refit, self.total_seconds
        check = " + the refit check's scoring" if refit.check_every_steps else ""
        start = cfg.rollout.engine_start_timeout_seconds
        auto = ", auto: 300 s + 1.25 s per GiB of checkpoint per engine of a node" if start <= 0 else ""
        parts = [
            f"engine start {self.engine_start_seconds:,.0f} s ({TRAINER_HELLO_SECONDS} s hellos + "
            f"{self.engine_start_seconds - TRAINER_HELLO_SECONDS:,.0f} s: rollout.engine_start_timeout_seconds="
            f"{start:g}{auto})",
            f"refit {self.refit_seconds:,.0f} s (refit.max_attempts={refit.max_attempts} x (attempt + group build: "
            f"3 x refit.timeout_seconds={refit.timeout_seconds:g}){check})",
            f"batch {self.batch_seconds:,.0f} s (agent.rollout_timeout_seconds={cfg.agent.rollout_timeout_seconds:g} "
            f"x 2 + 60 + payloads.fetch_timeout_seconds={cfg.payloads.fetch_timeout_seconds:g})",
            f"margin {self.margin_seconds:,.0f} s"]
        return f"trainer group timeout: {total:,.0f} s ({total / 3600:.1f} h) = " + " + ".join(parts)


def trainer_group_timeout(cfg: MoltConfig, checkpoint_bytes: int | None = None) -> TrainerGroupTimeout:
    """The trainer group's collective timeout, from the waits rank 0 may make while ranks 1.. sit in
    a collective (TrainerGroupTimeout's fields say which). `checkpoint_bytes`: the model's size when
    model.path is not on this machine (--dry-run), for the automatic engine-start limit."""
    refit = cfg.refit
    return TrainerGroupTimeout(
        engine_start_seconds=TRAINER_HELLO_SECONDS + engine_start_limit_seconds(cfg, checkpoint_bytes),
        refit_seconds=(refit.max_attempts * 3 * refit.timeout_seconds
                       + (refit.timeout_seconds if refit.check_every_steps else 0.0)),
        batch_seconds=cfg.agent.rollout_timeout_seconds * 2 + 60 + cfg.payloads.fetch_timeout_seconds)
