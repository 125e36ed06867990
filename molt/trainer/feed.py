"""Where a trainer rank's batch comes from (DESIGN section 2, stages 6-7), one role per rank, chosen once.

On rank 0, `LeadFeed` takes each step's complete groups from the rollout controller (molt.controller.pool,
handed in by molt.train), balances them over the data-parallel ranks and sends every other trainer rank
its share; on ranks 1.., `FollowerFeed` receives that share. Either way a rank then reloads only its own
share's payloads from the rollout ranks' stores (DESIGN section 7) and frees them once trained on.
"""

from __future__ import annotations

import logging

from molt.config import MoltConfig
from molt.distributed.parallelize import TrainerMesh
from molt.metrics import MetricsLogger
from molt.trace.experience import Experience
from molt.trainer.batch import share_step_batch
from molt.trainer.learner import BatchInfo
from molt.transport.payloads import PayloadClient, PayloadRef, default_node_id, reload_record
from molt.transport.wire import ControllerAddress, connect_dealer, pack, unpack

logger = logging.getLogger("molt")

# A step's batch on one rank: its experiences, the batch's rewards and groups, the micro-batch count of
# each optimizer window (the same on every rank), and rank 0's rollout metrics ({} elsewhere).
Batch = tuple[list[Experience], BatchInfo, list[int], dict[str, float]]


class RolloutsFailedError(RuntimeError):
    """Every rollout of agent.max_failed_steps consecutive steps failed; raised on every trainer rank
    after the rollout ranks have stopped, so the job ends cleanly (molt.train exits 1)."""


class Feed:
    """What both roles share: reloading this rank's payloads and freeing them."""

    def __init__(self, cfg: MoltConfig, payloads: PayloadClient, *, mesh: TrainerMesh):
        """`payloads`: experiences arrive as light records; each rank fetches its own share's token-axis
        fields from the payload store of the rollout rank that produced them (DESIGN section 7).
        `mesh`: the trainer mesh (molt.distributed.parallelize), whose tp ranks share a share."""
        self.cfg, self.payloads, self.mesh = cfg, payloads, mesh
        self.unreleased_payloads: list[PayloadRef] = []  # see reload

    def reload(self, experiences: list[Experience]) -> list[Experience]:
        """Full experiences from light records. Each payload is freed at its store once here, or with
        tensor parallelism, where every rank of a tensor-parallel group reloads the same share, by the
        group's first rank after the step's training (`release`): its collectives have then made sure
        the others hold their copies."""
        consume = self.mesh.tp_size == 1
        if not consume and self.mesh.tp_rank == 0:
            self.unreleased_payloads += [PayloadRef.from_dict(e.payload) for e in experiences if e.payload is not None]
        return [reload_record(self.payloads, e, consume=consume) if e.payload is not None else e for e in experiences]

    def release(self) -> None:
        for ref in self.unreleased_payloads:
            self.payloads.release(ref)
        self.unreleased_payloads = []

    def evaluate(self, step: int, policy_version: int) -> None:
        """When eval.every_steps makes it due, evaluate the policy after `step` steps on the rollout engines
        (molt.controller.evaluation) and log the eval/* metrics as a row of that step (rank 0)."""

    def sleep_engines(self) -> None:
        """rollout.sleep_while_training: the step's rollouts are in (rank 0 tells the engines)."""

    def state_dict(self) -> dict | None:
        return None  # the controller's, on rank 0

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        self.payloads.close()


class LeadFeed(Feed):
    """Rank 0: collects each step's rollouts from the controller, assembles the batch, sends each
    trainer rank its share, keeps its own."""

    def __init__(self, cfg: MoltConfig, controller, *, metrics: MetricsLogger, mesh: TrainerMesh, layout: str):
        """`controller`: molt.controller.pool.RolloutController, whose payload client this rank shares;
        `layout`: molt.trainer.batch.LAYOUTS."""
        super().__init__(cfg, controller.payloads, mesh=mesh)
        self.controller, self.metrics, self.layout = controller, metrics, layout
        self.num_trainer_ranks = cfg.layout.num_trainer_ranks
        self.stop_message = ""  # why the job stops for failed rollouts (see close)

    def connect(self) -> None:
        self.controller.wait_for_ranks(self.num_trainer_ranks)

    def next_batch(self, step: int, policy_version: int) -> Batch:
        rollouts = self.controller.collect_step(policy_version, step=step)
        self.stop_for_failed_rollouts(step, rollouts)
        experiences = [e for group in rollouts.groups for e in group]
        shares, micro_batch_counts = share_step_batch(
            experiences, num_ranks=self.mesh.dp_size, num_windows=self.cfg.train.mini_batches_per_step,
            max_tokens_per_micro_batch=self.cfg.train.max_tokens_per_micro_batch, layout=self.layout)
        batch = dict(rollout_ids=[e.rollout_id for e in experiences], group_ids=[e.group_id for e in experiences],
                     rewards=[e.reward for e in experiences], segment_indices=[e.segment_index for e in experiences])
        for rank in range(1, self.num_trainer_ranks):
            share = shares[rank // self.mesh.tp_size]  # trainer rank r: data-parallel index r // tp
            self.controller.mailbox.send_to_trainer_rank(rank, {
                "type": "batch", "experiences": [experiences[i].to_dict() for i in share],
                "info": BatchInfo(**batch, own=share).to_dict(), "micro_batch_counts": micro_batch_counts})
        if not experiences:
            logger.warning("no complete group this step (failures: %s); the step trains on nothing",
                           dict(rollouts.failures))
        own = shares[0]
        self.metrics.log_prompts(policy_version + 1, rollouts.trained_prompts, rollouts.dropped_prompts)
        metrics = {**rollouts.metrics(experiences), **self.controller.traffic_metrics()}
        reloaded = self.reload([experiences[i] for i in own])
        # What this rank trains on after the reload: each experience's images came back with it.
        metrics["train/rank0_images"] = float(sum(e.images.num_images for e in reloaded if e.images is not None))
        return reloaded, BatchInfo(**batch, own=own), micro_batch_counts, metrics

    def stop_for_failed_rollouts(self, step: int, rollouts) -> None:
        """After agent.max_failed_steps steps whose every rollout failed, log this step and raise (the
        trainer then closes this feed, which stops the rollout ranks and the other trainer ranks).
        Before that, each such step trains on nothing."""
        reason = self.controller.failed_steps.record(rollouts)
        if reason is None:
            return
        self.metrics.log(step, rollouts.metrics([]))
        self.stop_message = f"step {step}: {reason}"
        logger.error("%s; stopping the job", self.stop_message)
        raise RolloutsFailedError(self.stop_message)

    def evaluate(self, step: int, policy_version: int) -> None:
        """It runs before the next step's rollouts, so the next refit waits for it; the other trainer
        ranks wait for their batch meanwhile, in no collective. The row is outside the step's timers."""
        if not self.cfg.eval.due(step):
            return
        metrics, _ = self.controller.run_eval(step, policy_version)
        k = self.cfg.eval.n_samples
        logger.info("eval of step %d (policy version %d): avg@%d %.3f, pass@%d %.3f over %d prompts in %.1f s",
                    step, policy_version, k, metrics[f"eval/avg@{k}"], k, metrics[f"eval/pass@{k}"],
                    metrics["eval/num_prompts"], metrics["eval/seconds"])
        self.metrics.log(step, metrics)

    def sleep_engines(self) -> None:
        """Each engine frees its GPU memory for the step and wakes at its next refit, rollout or score
        (molt.rollout.rank.wakes_engine)."""
        if self.cfg.rollout.sleep_while_training:
            self.controller.mailbox.send_to_rollout_ranks({"type": "sleep"})

    def state_dict(self) -> dict:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state)

    def close(self) -> None:
        self.controller.close()  # the rollout ranks stop first (it waits for them); it closes the payload client
        if self.stop_message:  # rollouts failed: the other trainer ranks wait for their batch
            for rank in range(1, self.num_trainer_ranks):
                self.controller.mailbox.send_to_trainer_rank(rank, {"type": "stop", "error": self.stop_message})


class FollowerFeed(Feed):
    """Trainer ranks 1..: receive this rank's share from rank 0 and reload its payloads."""

    def __init__(self, cfg: MoltConfig, controller_address: ControllerAddress, *, rank: int, mesh: TrainerMesh):
        payloads = PayloadClient(default_node_id(cfg.payloads.node_id), spill_dir=cfg.payloads.spill_dir or None,
                                 timeout_seconds=cfg.payloads.fetch_timeout_seconds)
        super().__init__(cfg, payloads, mesh=mesh)
        self.controller_address, self.rank = controller_address, rank

    def connect(self) -> None:
        self.inbox = connect_dealer(self.controller_address, f"trainer-{self.rank}")
        self.inbox.send(pack({"type": "hello", "rank": self.rank}))

    def next_batch(self, step: int, policy_version: int) -> Batch:
        message = unpack(self.inbox.recv())
        if message["type"] == "stop":
            raise RolloutsFailedError(message["error"])
        experiences = self.reload([Experience.from_dict(e) for e in message["experiences"]])
        return experiences, BatchInfo(**message["info"]), message["micro_batch_counts"], {}
