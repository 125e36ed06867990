"""The training loop of the trainer ranks: the algorithm, the same on every rank. What differs by rank
is chosen once, at construction: rank 0's batch feed and refit coordinator drive the rollout controller
(molt.trainer.feed, molt.refit.coordinator); the other trainer ranks' roles follow them."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from molt.config import MoltConfig
from molt.console import StepProgress
from molt.distributed.devices import release_cache_before_wake
from molt.distributed.parallelize import TrainerMesh
from molt.metrics import MetricsLogger, StageTimer, process_resources
from molt.refit.backends import build_sender
from molt.refit.coordinator import RefitCoordinator, RefitFollower
from molt.trace.experience import Experience
from molt.trainer.batch import MicroBatch, build_windows
from molt.trainer.checkpoint import (STOP_REQUEST, checkpoint_run_id, load_checkpoint, new_run_id, read_wandb_run_id,
                                     resolve_resume, save_checkpoint)
from molt.trainer.diagnostics import (PREFIX, WATCHED_RATIOS, DiagnosticsReport, DropWatcher, StepDiagnostics,
                                      count_digest_mismatches)
from molt.trainer.feed import Batch, FollowerFeed, LeadFeed, RolloutsFailedError
from molt.trainer.learner import Learner
from molt.trainer.policy import build_policy
from molt.transport.wire import ControllerAddress

logger = logging.getLogger("molt")

# A fixed probe for the refit check: engine and trainer score the same tokens.
PROBE_LENGTH = 32


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had a NaN/inf loss or gradient norm; the message names the step."""


class Trainer:
    def __init__(self, cfg: MoltConfig, *, rank: int, group: dist.ProcessGroup, mesh: TrainerMesh,
                 device: torch.device, host: str, controller=None, controller_address: ControllerAddress | None = None):
        """`group`: all trainer ranks (control broadcasts, checkpoints, refit gathers); `mesh`: the
        trainer mesh (molt.distributed.parallelize.build_trainer_mesh), whose dp_group sums the data;
        `controller`: rank 0's molt.controller.pool.RolloutController, which makes this rank the lead: its
        batch feed and refit coordinator drive the rollout ranks; the other trainer ranks get
        `controller_address` instead, where the lead's feed sends them their shares."""
        self.cfg = cfg
        self.rank = rank
        self.group = group
        self.device = device
        self.reports = controller is not None  # the lead logs the job's metrics, progress and warnings
        self.num_trainer_ranks = cfg.layout.num_trainer_ranks
        policy = build_policy(cfg, mesh=mesh, device=device, num_steps=cfg.train.num_steps,
                              temperature=cfg.rollout.temperature, routing_replay=cfg.algorithm.routing_replay)
        self.actor, self.pad_token_id = policy.actor, policy.pad_token_id
        self.micro_batch_layout = policy.micro_batch_layout  # molt.trainer.batch.LAYOUTS
        self.learner = Learner(cfg, self.actor, mesh=mesh, device=device)
        sender = build_sender(cfg, self.actor.model, is_sender=self.reports, device=device)  # molt.refit
        self.timer = StageTimer()
        self.resume_path = resolve_resume(cfg.checkpoint.resume, cfg.checkpoint_dir)
        # Marks the checkpoints rank 0 writes, so rotation leaves other runs' alone; a resumed run keeps its id.
        self.run_id = checkpoint_run_id(self.resume_path) if self.resume_path else new_run_id()
        if self.reports and self.resume_path is None:
            remove_stale_metrics(cfg.output_dir)
        self.metrics = MetricsLogger(wandb_run_id=read_wandb_run_id(self.resume_path),
                                     output_dir=cfg.output_dir, run_name=cfg.name, config=cfg.to_dict(),
                                     wandb_mode=cfg.metrics.wandb_mode, wandb_project=cfg.metrics.wandb_project,
                                     total_steps=cfg.train.num_steps, enabled=self.reports)
        # Each rank's roles, chosen once (molt.trainer.feed, molt.refit.coordinator).
        if controller is not None:
            self.feed = LeadFeed(cfg, controller, metrics=self.metrics, mesh=mesh, layout=self.micro_batch_layout)
            self.refit = RefitCoordinator(cfg, sender, controller.mailbox, host=host, group=group, device=device)
        else:
            self.feed = FollowerFeed(cfg, controller_address, rank=rank, mesh=mesh)
            self.refit = RefitFollower(cfg, sender, group=group, device=device)
        self.policy_version = 0
        self.skipped_nonfinite_steps = 0  # steps whose loss or gradient norm was not finite
        self.nonfinite_streak = 0
        self.last_updated_step = 0  # the last step that changed the weights (0: none this run)
        self.progress = StepProgress(total_steps=cfg.train.num_steps, enabled=self.reports)
        self.drop_watch = DropWatcher(WATCHED_RATIOS)

    def train(self) -> None:
        first_step = self.resume() + 1
        self.feed.connect()  # every engine ready (and, on the lead, every trainer rank connected)
        self.refit.connect()
        pending_check = {}
        if first_step > 1:  # engines load model.path: they get the checkpoint's weights before any rollout
            self.push_weights(version=self.policy_version)
            if self.cfg.refit.check_every_steps:
                pending_check = self.check_refit()  # logged with the first resumed step
        elif self.cfg.refit.check_every_steps:  # engines and trainer start from the same weights
            self.metrics.log(0, self.check_refit())
        self.progress.start(first_step)
        for step in range(first_step, self.cfg.train.num_steps + 1):
            self.feed.evaluate(step - 1, self.policy_version)  # the last step's policy, before this step's rollouts
            started = time.perf_counter()
            with self.timer.stage("rollout"):
                experiences, info, micro_batch_counts, rollout_metrics = self.next_batch(step)
            self.feed.sleep_engines()
            with self.timer.stage("train"):
                windows = build_windows(
                    experiences, num_windows=len(micro_batch_counts), micro_batch_counts=micro_batch_counts,
                    max_tokens_per_micro_batch=self.cfg.train.max_tokens_per_micro_batch,
                    pad_token_id=self.pad_token_id, layout=self.micro_batch_layout,
                    temperature=self.cfg.rollout.temperature)
                diagnostics = self.check_trace(step, experiences, windows)
                train_metrics = self.learner.train_step(windows, info, diagnostics)
                report = self.report_diagnostics(step, diagnostics)
                self.feed.release()
            self.count_nonfinite(step, train_metrics)
            self.release_cached_memory()
            if train_metrics["updated"]:
                with self.timer.stage("refit"):
                    self.push_weights(version=self.policy_version + 1)
            check_metrics = {**pending_check, **(self.check_refit() if self.refit_check_due(step) else {})}
            pending_check = {}
            step_seconds = time.perf_counter() - started
            step_metrics = {**rollout_metrics, **{f"train/{k}": v for k, v in train_metrics.items()},
                            **report.metrics, **check_metrics, **self.timer.pop(), "time/step_seconds": step_seconds,
                            "refit/failed_attempts": float(self.refit.failures),
                            "train/skipped_nonfinite_steps": float(self.skipped_nonfinite_steps),
                            "policy_version": float(self.policy_version),
                            **process_resources("trainer_rank0"),
                            "throughput/tokens_per_second": rollout_metrics.get("rollout/tokens", 0) / step_seconds}
            self.metrics.log(step, step_metrics, histograms=report.histograms)
            self.progress.update(step, step_metrics)
            self.stop_after_nonfinite_streak(step)
            interval = self.cfg.checkpoint.interval_steps
            stopping = self.stop_requested(step)
            if (interval and step % interval == 0) or stopping:
                with self.timer.stage("checkpoint"):  # shows in the next step's metrics
                    self.save_checkpoint(step)
            if stopping:
                break
        else:
            self.feed.evaluate(self.cfg.train.num_steps, self.policy_version)
        self.shutdown()

    def check_trace(self, step: int, experiences: list[Experience], windows: list[list[MicroBatch]]) -> StepDiagnostics:
        """The step's diagnostics (molt.trainer.diagnostics), starting with the end-to-end token check: this
        rank's micro-batch rows against the digest the rollout rank took of what the engine sampled.
        A mismatch is an error naming the step and the rollouts: those tokens were sampled by no policy."""
        diagnostics = StepDiagnostics(self.device)
        mismatched, rollout_ids = count_digest_mismatches(
            [micro_batch for window in windows for micro_batch in window], experiences)
        diagnostics.add_sum("token_mismatches", mismatched)
        if mismatched:
            logger.error("step %d: %d action tokens of rollouts %s differ from the ids the engine sampled (their "
                         "action digest): the trainer is not training on its own samples",
                         step, mismatched, rollout_ids)
        return diagnostics

    def report_diagnostics(self, step: int, diagnostics: StepDiagnostics) -> DiagnosticsReport:
        """The step's diagnostics over the data-parallel ranks (collective); rank 0 warns on a
        sudden drop of a watched ratio and on any token mismatch."""
        report = diagnostics.reduce(self.learner.group)
        if self.reports:
            self.drop_watch.observe(step, report.metrics)
            for name in ("token_mismatches", "model_input_mismatches"):
                if report.metrics[PREFIX + name]:
                    logger.error("step %d: %s%s = %d, must be 0 (each trainer rank's log names its rollouts)",
                                 step, PREFIX, name, report.metrics[PREFIX + name])
        return report

    def count_nonfinite(self, step: int, metrics: dict[str, float]) -> None:
        """Count a step whose loss or gradient norm was not finite (every rank sees the same all-reduced
        values, so all agree) and say so; `stop_after_nonfinite_streak` ends the job after too many."""
        if metrics["updated"]:
            self.last_updated_step = step
        if not metrics["skipped_nonfinite"]:
            self.nonfinite_streak = 0
            return
        self.skipped_nonfinite_steps += 1
        self.nonfinite_streak += 1
        applied = int(metrics["optimizer_steps"])
        if self.reports:
            logger.error("step %d: non-finite loss (%s) or gradient norm (%s); the optimizer window took no step "
                         "on any rank (%d earlier window(s) of this step did), %s; %d such step(s) in a row, the job "
                         "stops at train.max_consecutive_nonfinite_steps=%d", step, metrics["loss"], metrics["grad_norm"],
                         applied, "weights pushed" if applied else "no weights pushed", self.nonfinite_streak,
                         self.cfg.train.max_consecutive_nonfinite_steps)

    def stop_after_nonfinite_streak(self, step: int) -> None:
        limit = self.cfg.train.max_consecutive_nonfinite_steps
        if self.nonfinite_streak < limit:
            return
        raise NonFiniteTrainingError(
            f"step {step}: {self.nonfinite_streak} consecutive steps had a non-finite loss or gradient norm "
            f"(train.max_consecutive_nonfinite_steps={limit}); "
            + (f"the weights were last updated at step {self.last_updated_step}" if self.last_updated_step
               else "no step of this run updated the weights")
            + ". Look for NaN/inf or huge rewards and log-probs, or lower train.learning_rate")

    # -- checkpoints -----------------------------------------------------------------------

    def trainables(self) -> dict:
        return {"actor": self.actor, "critic": self.learner.critic}

    def resume(self) -> int:
        """Load the checkpoint checkpoint.resume names (collective); returns its step, 0 for a fresh start."""
        if self.resume_path is None:
            return 0
        state = load_checkpoint(self.resume_path, trainables=self.trainables(), group=self.group, rank=self.rank)
        self.learner.load_state_dict(state["learner"])
        self.policy_version = state["policy_version"]
        self.skipped_nonfinite_steps = state.get("skipped_nonfinite_steps", 0)
        self.feed.load_state_dict(state["controller"])
        logger.info("resumed from %s: step %d, policy version %d", self.resume_path, state["step"], self.policy_version)
        return state["step"]

    def stop_requested(self, step: int) -> bool:
        """Whether any trainer rank got a stop signal (molt.trainer.checkpoint.StopRequest); one tiny
        all-reduce, so every rank stops after the same step."""
        flag = torch.tensor([int(STOP_REQUEST.requested)], device=self.device)
        if self.num_trainer_ranks > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return False
        if self.reports:
            logger.warning("step %d: stop requested (%s); writing a checkpoint and exiting, resume with "
                           "checkpoint.resume=auto", step, STOP_REQUEST.signal_name or "on another trainer rank")
        return True

    def save_checkpoint(self, step: int) -> None:
        state = None  # written by the lead, the rank whose feed holds the controller's state
        if (controller_state := self.feed.state_dict()) is not None:
            state = {"step": step, "policy_version": self.policy_version, "learner": self.learner.state_dict(),
                     "skipped_nonfinite_steps": self.skipped_nonfinite_steps,
                     "controller": controller_state, "wandb_run_id": self.metrics.run_id,
                     "model_path": self.cfg.model.path}
        save_checkpoint(self.cfg.checkpoint_dir, step, trainables=self.trainables(), group=self.group,
                        rank=self.rank, state=state, keep_last=self.cfg.checkpoint.keep_last, run_id=self.run_id)

    # -- batches, refits and the end -------------------------------------------------------

    def next_batch(self, step: int) -> Batch:
        try:
            return self.feed.next_batch(step, self.policy_version)
        except RolloutsFailedError:  # the rollout ranks have stopped (rank 0 logged why): stop in order
            self.shutdown()
            raise

    def release_cached_memory(self) -> None:
        """Before the engine on this rank's GPU wakes for the refit (rollout.sleep_while_training), hand
        the step's cached, freed memory back to the driver (molt.distributed.devices.release_cache_before_wake)."""
        if release_cache_before_wake(self.device.type, self.cfg.rollout.sleep_while_training):
            torch.cuda.empty_cache()

    def push_weights(self, version: int) -> None:
        """The new weights into every engine (molt.refit.coordinator), then this rank's policy version."""
        self.refit.push(version)
        self.policy_version = version

    def shutdown(self) -> None:
        self.progress.close()
        self.feed.close()  # on the lead, also stops the rollout ranks
        self.metrics.close()

    def refit_check_due(self, step: int) -> bool:
        every = self.cfg.refit.check_every_steps
        return bool(every) and step % every == 0

    def check_refit(self) -> dict[str, float]:
        """Score a fixed probe on the engines and on the trainer; return the largest log-prob gap.

        Collective over the trainer group (the trainer's forward pass is sharded)."""
        generator = torch.Generator().manual_seed(1234)
        vocab_size = self.actor.model.config.get_text_config().vocab_size
        probe = torch.randint(0, vocab_size, (1, PROBE_LENGTH), generator=generator)
        # An image placeholder without its image means nothing to an engine (nor to the model): text only.
        image_token = getattr(self.actor.model.config, "image_token_id", None)
        if image_token is not None:
            probe[probe == image_token] = (image_token + 1) % vocab_size
        # The trainer scores at the sampling temperature; the check compares at temperature 1.
        temperature, self.actor.temperature = self.actor.temperature, 1.0
        try:
            trainer_logprobs = self.actor.compute_logprobs(probe.to(self.device), torch.ones_like(probe).to(self.device))
        finally:
            self.actor.temperature = temperature
        return self.refit.compare(probe[0].tolist(), trainer_logprobs)  # {} but on the lead


def remove_stale_metrics(output_dir: str) -> None:
    """A fresh run starts fresh metrics.jsonl and prompts.jsonl (the logger appends to them, so
    that a resumed run continues them)."""
    for name in ("metrics.jsonl", "prompts.jsonl"):
        Path(output_dir, name).unlink(missing_ok=True)
