"""The training loop of the trainer ranks (rank 0 also runs the rollout controller)."""

from __future__ import annotations

import logging
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from molt.config import MoltConfig
from molt.console import StepProgress
from molt.controller.evaluation import eval_due
from molt.controller.pool import (ROLLOUT_RANK_STOP_SECONDS, FailedStepStreak, RolloutController, StepRollouts,
                                  compute_staleness)
from molt.controller.prompts import PromptRow
from molt.distributed.devices import release_cache_before_wake
from molt.distributed.parallelize import TrainerMesh
from molt.metrics import MetricsLogger, StageTimer, process_resources
from molt.refit.backends import build_sender
from molt.refit.weight_sync import RefitError, RefitSendError, engine_first_rank, refit_world_size
from molt.trace.experience import Experience
from molt.trainer.batch import MicroBatch, build_windows, share_step_batch
from molt.trainer.checkpoint import (STOP_REQUEST, checkpoint_run_id, load_checkpoint, new_run_id, read_wandb_run_id,
                                     resolve_resume, save_checkpoint)
from molt.trainer.diagnostics import (PREFIX, WATCHED_RATIOS, DiagnosticsReport, DropWatcher, StepDiagnostics,
                                      count_digest_mismatches)
from molt.trainer.learner import BatchInfo, Learner
from molt.trainer.policy import build_policy
from molt.transport.payloads import PayloadClient, PayloadRef, default_node_id, reload_record
from molt.transport.wire import ControllerAddress, Router, connect_dealer, pack, unpack

logger = logging.getLogger("molt")

# A fixed probe for the refit check: engine and trainer score the same tokens.
PROBE_LENGTH = 32


class NonFiniteTrainingError(RuntimeError):
    """Too many consecutive steps had a NaN/inf loss or gradient norm; the message names the step."""


class RolloutsFailedError(RuntimeError):
    """Every rollout of agent.max_failed_steps consecutive steps failed; raised on every trainer rank
    after the rollout ranks have stopped, so the job ends cleanly (molt.train exits 1)."""


class Trainer:
    def __init__(self, cfg: MoltConfig, *, rank: int, group: dist.ProcessGroup, mesh: TrainerMesh,
                 device: torch.device, host: str, controller_address: ControllerAddress, router: Router | None,
                 rollout_ranks: list[int], prompt_rows: list[PromptRow] | None = None):
        """`group`: all trainer ranks (control broadcasts, checkpoints, refit gathers); `mesh`: the
        trainer mesh (molt.distributed.parallelize.build_trainer_mesh), whose dp_group sums the data;
        `prompt_rows`: data.train_path's rows when already read (rank 0; None reads the file)."""
        self.cfg = cfg
        self.rank = rank
        self.group = group
        self.device = device
        self.host = host
        self.is_controller = rank == 0
        self.num_trainer_ranks = cfg.layout.num_trainer_ranks
        # Trainer rank r is tensor-parallel rank r % tp of data-parallel rank r // tp (molt.distributed.parallelize).
        self.tp_size, self.tp_rank, self.dp_size = mesh.tp_size, mesh.tp_rank, mesh.dp_size
        self.unreleased_payloads: list[PayloadRef] = []  # see reload
        policy = build_policy(cfg, mesh=mesh, device=device, num_steps=cfg.train.num_steps,
                              temperature=cfg.rollout.temperature, routing_replay=cfg.algorithm.routing_replay)
        self.actor, self.pad_token_id = policy.actor, policy.pad_token_id
        self.micro_batch_layout = policy.micro_batch_layout  # molt.trainer.batch.LAYOUTS
        self.learner = Learner(cfg, self.actor, mesh=mesh, device=device)
        self.refit = build_sender(cfg, self.actor.model, is_sender=self.is_controller, device=device)  # molt.refit
        # Experiences arrive as light records; each rank fetches its own share's token-axis fields
        # from the payload store of the rollout rank that produced them (DESIGN section 7).
        self.payloads = PayloadClient(default_node_id(cfg.payloads.node_id), spill_dir=cfg.payloads.spill_dir or None,
                                      timeout_seconds=cfg.payloads.fetch_timeout_seconds)
        self.router = router
        self.controller_address = controller_address
        self.controller = (RolloutController(cfg, router, rollout_ranks, prompt_rows=prompt_rows)
                           if self.is_controller else None)
        self.rollout_ranks = rollout_ranks
        self.timer = StageTimer()
        self.resume_path = resolve_resume(cfg.checkpoint.resume, cfg.checkpoint_dir)
        # Marks the checkpoints rank 0 writes, so rotation leaves other runs' alone; a resumed run keeps its id.
        self.run_id = checkpoint_run_id(self.resume_path) if self.resume_path else new_run_id()
        if self.is_controller and self.resume_path is None:
            remove_stale_metrics(cfg.output_dir)
        self.metrics = MetricsLogger(wandb_run_id=read_wandb_run_id(self.resume_path),
                                     output_dir=cfg.output_dir, run_name=cfg.name, config=cfg.to_dict(),
                                     wandb_mode=cfg.metrics.wandb_mode, wandb_project=cfg.metrics.wandb_project,
                                     total_steps=cfg.train.num_steps, enabled=self.is_controller)
        self.policy_version = 0
        self.refit_failures = 0  # failed refit attempts so far (each retried or fatal)
        self.skipped_nonfinite_steps = 0  # steps whose loss or gradient norm was not finite
        self.nonfinite_streak = 0
        self.last_updated_step = 0  # the last step that changed the weights (0: none this run)
        self.failed_steps = FailedStepStreak(cfg.agent.max_failed_steps)
        self.progress = StepProgress(total_steps=cfg.train.num_steps, enabled=self.is_controller)
        self.drop_watch = DropWatcher(WATCHED_RATIOS)

    def train(self) -> None:
        first_step = self.resume() + 1
        self.connect_engines()
        pending_check = {}
        if first_step > 1:  # engines load model.path: they get the checkpoint's weights before any rollout
            self.push_weights(version=self.policy_version)
            if self.cfg.refit.check_every_steps:
                pending_check = self.check_refit()  # logged with the first resumed step
        elif self.cfg.refit.check_every_steps:  # engines and trainer start from the same weights
            self.metrics.log(0, self.check_refit())
        self.progress.start(first_step)
        for step in range(first_step, self.cfg.train.num_steps + 1):
            self.evaluate(step - 1)  # the policy the last step made, before this step's rollouts
            started = time.perf_counter()
            with self.timer.stage("rollout"):
                experiences, info, micro_batch_counts, rollout_metrics = self.next_batch(step)
            self.sleep_engines()
            with self.timer.stage("train"):
                windows = build_windows(
                    experiences, num_windows=len(micro_batch_counts), micro_batch_counts=micro_batch_counts,
                    max_tokens_per_micro_batch=self.cfg.train.max_tokens_per_micro_batch,
                    pad_token_id=self.pad_token_id, layout=self.micro_batch_layout,
                    temperature=self.cfg.rollout.temperature)
                diagnostics = self.check_trace(step, experiences, windows)
                train_metrics = self.learner.train_step(windows, info, diagnostics)
                report = self.report_diagnostics(step, diagnostics)
                self.release_payloads()
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
                            "refit/failed_attempts": float(self.refit_failures),
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
            self.evaluate(self.cfg.train.num_steps)
        self.shutdown()

    def evaluate(self, step: int) -> None:
        """Controller only, when eval.every_steps makes it due: evaluate the policy after `step` steps
        on the rollout engines (molt.controller.evaluation) and log the eval/* metrics as a row of that step.
        It runs before the next step's rollouts, so the next refit waits for it, and outside the
        step's timers; the other trainer ranks wait for their batch meanwhile, in no collective."""
        if not self.is_controller or not eval_due(step, self.cfg.eval):
            return
        metrics, _ = self.controller.run_eval(step, self.policy_version)
        self.metrics.log(step, metrics)
        k = self.cfg.eval.n_samples
        logger.info("eval of step %d (policy version %d): avg@%d %.3f, pass@%d %.3f over %d prompts in %.1f s",
                    step, self.policy_version, k, metrics[f"eval/avg@{k}"], k, metrics[f"eval/pass@{k}"],
                    metrics["eval/num_prompts"], metrics["eval/seconds"])

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
        if self.is_controller:
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
        if self.is_controller:
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
        if self.is_controller:
            self.controller.load_state_dict(state["controller"])
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
        if self.is_controller:
            logger.warning("step %d: stop requested (%s); writing a checkpoint and exiting, resume with "
                           "checkpoint.resume=auto", step, STOP_REQUEST.signal_name or "on another trainer rank")
        return True

    def save_checkpoint(self, step: int) -> None:
        state = None
        if self.is_controller:
            state = {"step": step, "policy_version": self.policy_version, "learner": self.learner.state_dict(),
                     "skipped_nonfinite_steps": self.skipped_nonfinite_steps,
                     "controller": self.controller.state_dict(), "wandb_run_id": self.metrics.run_id,
                     "model_path": self.cfg.model.path}
        save_checkpoint(self.cfg.checkpoint_dir, step, trainables=self.trainables(), group=self.group,
                        rank=self.rank, state=state, keep_last=self.cfg.checkpoint.keep_last, run_id=self.run_id)

    # -- start and stop --------------------------------------------------------------------

    def connect_engines(self) -> None:
        """Wait for every engine, then build the refit group (trainer sender = refit rank 0)."""
        if not self.is_controller:
            self.inbox = connect_dealer(self.controller_address, f"trainer-{self.rank}")
            self.inbox.send(pack({"type": "hello", "rank": self.rank}))
            return
        self.controller.wait_for_ranks(self.num_trainer_ranks)
        self.open_refit_group()
        logger.info("engines ready; %s refit group of %d ranks, %d buckets", self.refit.backend,
                    refit_world_size(len(self.rollout_ranks), self.cfg.layout.engine_tensor_parallel_size),
                    len(self.refit.buckets))

    def open_refit_group(self) -> None:
        """Controller only: a fresh refit group with every worker of every engine (at start, and after a
        failed refit). Each engine's join message carries its first refit rank; its tensor-parallel
        workers take that rank and the next ones (molt.refit.weight_sync)."""
        self.refit.close_group()
        tensor_parallel = self.cfg.layout.engine_tensor_parallel_size
        group = self.refit.group_message(self.host, refit_world_size(len(self.rollout_ranks), tensor_parallel))
        for index, rank in enumerate(self.rollout_ranks):
            self.router.send(f"rollout-{rank}", {"type": "join_refit",
                                                 "group": {**group, "rank": engine_first_rank(index, tensor_parallel)}})
        try:
            self.refit.connect()
        except RefitSendError as error:  # an engine did not join: its rank's report, or its absence, names it
            absent = {self.rollout_ranks[(rank - 1) // tensor_parallel] for rank in error.absent_ranks}
            self.controller.await_joined(0.0, error, absent=absent)
        self.controller.await_joined(self.cfg.refit.timeout_seconds)

    def shutdown(self) -> None:
        self.progress.close()
        self.payloads.close()
        if self.is_controller:
            self.controller.shutdown(wait_seconds=ROLLOUT_RANK_STOP_SECONDS)
        self.metrics.close()

    def stop_for_failed_rollouts(self, step: int, rollouts: StepRollouts) -> None:
        """Controller only: after agent.max_failed_steps steps whose every rollout failed, log this
        step, stop the rollout ranks, then tell the other trainer ranks (waiting for their batch) to
        stop too, and raise. Before that, each such step trains on nothing."""
        reason = self.failed_steps.record(rollouts)
        if reason is None:
            return
        self.metrics.log(step, _rollout_metrics(rollouts, []))
        message = f"step {step}: {reason}"
        logger.error("%s; stopping the job", message)
        self.shutdown()
        for rank in range(1, self.num_trainer_ranks):
            self.router.send(f"trainer-{rank}", {"type": "stop", "error": message})
        raise RolloutsFailedError(message)

    # -- batches ---------------------------------------------------------------------------

    def sleep_engines(self) -> None:
        """rollout.sleep_while_training: the step's rollouts are in, so the engines free their GPU memory
        for the step; each wakes at its next refit, rollout or score (molt.rollout.rank.wakes_engine)."""
        if self.is_controller and self.cfg.rollout.sleep_while_training:
            self.controller.send_to_rollout_ranks({"type": "sleep"})

    def release_cached_memory(self) -> None:
        """Before the engine on this rank's GPU wakes for the refit (rollout.sleep_while_training), hand
        the step's cached, freed memory back to the driver (molt.distributed.devices.release_cache_before_wake)."""
        if release_cache_before_wake(self.device.type, self.cfg.rollout.sleep_while_training):
            torch.cuda.empty_cache()

    def next_batch(self, step: int) -> tuple[list[Experience], BatchInfo, list[int], dict[str, float]]:
        """This rank's experiences, the batch's rewards and groups, the micro-batch count of each
        optimizer window (the same on every rank), and metrics."""
        if self.is_controller:
            rollouts = self.controller.collect_step(self.policy_version, step=step)
            self.stop_for_failed_rollouts(step, rollouts)
            return self.assemble_batch(rollouts)
        message = unpack(self.inbox.recv())
        if message["type"] == "stop":
            self.shutdown()
            raise RolloutsFailedError(message["error"])
        experiences = self.reload([Experience.from_dict(e) for e in message["experiences"]])
        return experiences, BatchInfo(**message["info"]), message["micro_batch_counts"], {}

    def reload(self, experiences: list[Experience]) -> list[Experience]:
        """Full experiences from light records. Each payload is freed at its store once here, or with
        tensor parallelism, where every rank of a tensor-parallel group reloads the same share, by the
        group's first rank after the step's training (`release_payloads`): its collectives have then
        made sure the others hold their copies."""
        consume = self.tp_size == 1
        if not consume and self.tp_rank == 0:
            self.unreleased_payloads += [PayloadRef.from_dict(e.payload) for e in experiences if e.payload is not None]
        return [reload_record(self.payloads, e, consume=consume) if e.payload is not None else e for e in experiences]

    def release_payloads(self) -> None:
        for ref in self.unreleased_payloads:
            self.payloads.release(ref)
        self.unreleased_payloads = []

    def assemble_batch(self, rollouts: StepRollouts):
        """A balanced share of the step's experiences per data-parallel rank (the ranks of one
        tensor-parallel group get the same share), plus what every rank needs to compute advantages
        over the whole batch (each rollout counted once)."""
        experiences = [e for group in rollouts.groups for e in group]
        shares, micro_batch_counts = share_step_batch(
            experiences, num_ranks=self.dp_size, num_windows=self.cfg.train.mini_batches_per_step,
            max_tokens_per_micro_batch=self.cfg.train.max_tokens_per_micro_batch, layout=self.micro_batch_layout)
        batch = dict(rollout_ids=[e.rollout_id for e in experiences], group_ids=[e.group_id for e in experiences],
                     rewards=[e.reward for e in experiences], segment_indices=[e.segment_index for e in experiences])
        for rank in range(1, self.num_trainer_ranks):
            share = shares[rank // self.tp_size]  # trainer rank r: data-parallel index r // tp
            self.router.send(f"trainer-{rank}", {
                "type": "batch", "experiences": [experiences[i].to_dict() for i in share],
                "info": BatchInfo(**batch, own=share).to_dict(), "micro_batch_counts": micro_batch_counts})
        if not experiences:
            logger.warning("no complete group this step (failures: %s); the step trains on nothing",
                           dict(rollouts.failures))
        own = shares[0]
        self.metrics.log_prompts(self.policy_version + 1, rollouts.trained_prompts, rollouts.dropped_prompts)
        metrics = {**_rollout_metrics(rollouts, experiences),
                   # What passed through the controller's socket so far: references and control only.
                   "controller/bytes_received_total": float(self.router.bytes_received),
                   "controller/bytes_sent_total": float(self.router.bytes_sent),
                   "controller/token_values_received_total": float(self.controller.token_values_received)}
        reloaded = self.reload([experiences[i] for i in own])
        # What this rank trains on after the reload: each experience's images came back with it.
        metrics["train/rank0_images"] = float(sum(e.images.num_images for e in reloaded if e.images is not None))
        return reloaded, BatchInfo(**batch, own=own), micro_batch_counts, metrics

    # -- refit -----------------------------------------------------------------------------

    def push_weights(self, version: int) -> None:
        """Broadcast the new weights into every engine; returns when every engine has loaded them.

        One refit.timeout_seconds covers an attempt (broadcast and every engine's confirmation). A
        failed attempt is logged naming each engine that failed; the refit group is rebuilt and the
        refit retried, up to refit.max_attempts, after which RefitError stops the job. An engine
        that did not load the weights keeps sampling under its old version label, never a wrong one."""
        max_attempts = self.cfg.refit.max_attempts
        for attempt in range(1, max_attempts + 1):
            failure = self.attempt_refit(version, attempt)
            if not self.agree_with_controller(failure is not None):
                self.policy_version = version
                return
            self.refit_failures += 1
            if attempt == max_attempts:
                raise RefitError(f"{failure or 'refit failed on the engines (rank 0 logs which)'}; "
                                 f"gave up after refit.max_attempts={max_attempts}")
            if self.is_controller:
                logger.error("%s; rebuilding the refit group and retrying (attempt %d of %d)",
                             failure, attempt + 1, max_attempts)
                self.open_refit_group()

    def attempt_refit(self, version: int, attempt: int) -> str | None:
        """One refit attempt on every trainer rank; the controller returns what failed, if anything.

        The engines pause first; once every engine has said it is paused and ready, the controller
        says 'refit_go' and the sender broadcasts. If one did not by the deadline, it says
        'refit_cancel' (the paused engines drop the group without loading) and nothing is sent. Every
        trainer rank runs the FSDP2 gathers either way (`send=False` gathers only)."""
        deadline = time.monotonic() + self.cfg.refit.timeout_seconds
        not_paused = None
        if self.is_controller:
            self.controller.send_to_rollout_ranks({"type": "refit", "version": version, "attempt": attempt})
            not_paused = self.controller.await_paused(version, attempt, deadline)
            self.controller.decide_refit(version, attempt, go=not_paused is None)
        send_error = None
        started = time.perf_counter()
        try:
            num_bytes = self.refit.broadcast(send=not_paused is None)
        except RefitSendError as error:  # only the sender raises; the engines' replies say which one failed
            send_error, num_bytes = error, 0
        if not self.is_controller:
            return None
        failure = not_paused or self.controller.finish_refit(version, attempt, deadline, send_error)
        logger.debug("refit v%d: %.1f MB in %.2fs", version, num_bytes / 1e6, time.perf_counter() - started)
        return failure

    def agree_with_controller(self, flag: bool) -> bool:
        """The controller's flag, on every trainer rank (one tiny broadcast)."""
        if self.num_trainer_ranks == 1:
            return flag
        value = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(value, group_src=0, group=self.group)
        return bool(value.item())

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
        if not self.is_controller:
            return {}
        engine_logprobs = self.controller.score_on_engines(probe[0].tolist(), self.cfg.refit.timeout_seconds)
        reference = trainer_logprobs[0, 1:].double().cpu()
        gap = max((reference - torch.tensor(e[1:], dtype=torch.float64)).abs().max().item() for e in engine_logprobs)
        logger.info("refit check: max |engine - trainer| log-prob = %.3g", gap)
        return {"refit/max_abs_logprob_diff": gap}


def _rollout_metrics(rollouts: StepRollouts, experiences: list[Experience]) -> dict[str, float]:
    rewards = {e.rollout_id: e.reward for e in experiences}
    response_lengths = [e.num_action_tokens for e in experiences]
    metrics = {
        "reward/mean": statistics.fmean(rewards.values()) if rewards else math.nan,
        # With algorithm.filter_groups (or staleness drops), reward/mean covers the trained groups only.
        "reward/scored_mean": statistics.fmean(rollouts.scored_rewards) if rollouts.scored_rewards else math.nan,
        "rollout/num_rollouts": float(rollouts.num_rollouts),
        "rollout/num_groups": float(len(rollouts.groups)),
        "rollout/dropped_groups": float(rollouts.dropped_groups),
        "rollout/refilled": float(rollouts.refilled_rollouts),
        "rollout/failed": float(sum(rollouts.failures.values())),
        "rollout/tokens": float(sum(e.num_tokens for e in experiences)),
        "rollout/response_length_mean": statistics.fmean(response_lengths) if response_lengths else math.nan,
        "rollout/truncated_share": statistics.fmean(e.truncated for e in experiences) if experiences else math.nan,
        # The images stay in the rollout ranks' payload stores; the records say how many and how big.
        "rollout/images": float(sum(e.num_images for e in experiences)),
        "rollout/image_bytes": float(sum(e.image_bytes for e in experiences)),
    }
    metrics.update({f"rollout/failed_{reason}": float(n) for reason, n in rollouts.failures.items()})
    metrics.update({f"rollout/filtered_{reason}": float(n) for reason, n in rollouts.filtered_groups.items()})
    metrics["rollout/backfill_prompts"] = float(rollouts.backfill_prompts)
    metrics["rollout/stale_groups"] = float(rollouts.stale_groups)
    metrics.update(compute_staleness(rollouts.groups, rollouts.trained_version))
    metrics.update({"rollout/consumed": float(rollouts.consumed_rollouts), **rollouts.accounting})
    metrics["rollout/loop_lag_max_seconds"] = rollouts.loop_lag_max_seconds
    metrics.update({key: float(value) for key, value in rollouts.rank_metrics.items()})
    metrics.update({f"drift/{reason}": float(n) for reason, n in rollouts.ledger.items()})
    metrics["rollout/segments_per_rollout"] = len(experiences) / len(rewards) if rewards else math.nan
    infos: dict[str, list[float]] = {}
    for e in experiences:
        for key, value in e.info.items():
            infos.setdefault(key, []).append(value)
    metrics.update({f"agent/{k}": statistics.fmean(v) for k, v in infos.items()})
    return metrics


def remove_stale_metrics(output_dir: str) -> None:
    """A fresh run starts fresh metrics.jsonl and prompts.jsonl (the logger appends to them, so
    that a resumed run continues them)."""
    for name in ("metrics.jsonl", "prompts.jsonl"):
        Path(output_dir, name).unlink(missing_ok=True)
