import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from transformers import AutoModelForCausalLM, AutoTokenizer

from molt.config import MoltConfig, validate_config
from molt.controller.prompts import PromptRow
from molt.sft import chat_messages, iterate_batches, load_examples, sft_settings, tokenize_chat

REPO = Path(__file__).resolve().parents[1]
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "solve the question",
                                               "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def naive_mask(tokenizer, messages, tools=None) -> tuple[list[int], list[int]]:
    """Render the whole conversation once, then mark by hand the tokens of each assistant reply,
    located as '<|im_start|>assistant\\n' ... '<|im_end|>' in the text (the tiny model's ChatML)."""
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    ids, mask, position = [], [], 0
    opener, closer = "<|im_start|>assistant\n", tokenizer.eos_token
    while True:
        start = text.find(opener, position)
        if start < 0:
            break
        body_start = start + len(opener)
        body_end = text.index(closer, body_start) + len(closer)
        context = tokenizer.encode(text[position:body_start], add_special_tokens=False)
        reply = tokenizer.encode(text[body_start:body_end], add_special_tokens=False)
        ids += context + reply
        mask += [0] * len(context) + [1] * len(reply)
        position = body_end
    tail = tokenizer.encode(text[position:], add_special_tokens=False)
    return ids + tail, mask + [0] * len(tail)


def test_single_turn_mask_trains_the_answer_and_its_end_of_turn_token(tokenizer):
    messages = [{"role": "user", "content": "1+3="}, {"role": "assistant", "content": "4"}]
    ids, mask = tokenize_chat(tokenizer, messages)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
    answer = tokenizer.encode("4", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert ids == prompt + answer
    assert mask == [0] * len(prompt) + [1] * len(answer)
    naive_ids, naive = naive_mask(tokenizer, messages)
    # The whole rendering also has the newline after the last <|im_end|>: context, not trained.
    assert naive_ids[:len(ids)] == ids and naive[:len(mask)] == mask and not any(naive[len(mask):])


def test_multi_turn_mask_with_a_tool_call_trains_only_assistant_turns(tokenizer):
    call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+5="},
                {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "7"},
                {"role": "assistant", "content": "7"}, {"role": "user", "content": "and 1+1="},
                {"role": "assistant", "content": "2"}]
    ids, mask = tokenize_chat(tokenizer, messages, [CALCULATOR])
    naive_ids, naive = naive_mask(tokenizer, messages, [CALCULATOR])
    assert naive_ids[:len(ids)] == ids
    assert mask == naive[:len(mask)] and not any(naive[len(mask):])
    trained = tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert trained.count(tokenizer.eos_token) == 3 and "calculator" in trained and "2+5" not in trained


def test_label_row_becomes_the_assistant_answer():
    row = PromptRow(messages=[{"role": "user", "content": "3+4="}], label="7")
    assert chat_messages(row, "f:1") == [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]
    chat = PromptRow(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], label="x")
    assert chat_messages(chat, "f:1") == chat.messages  # ends with its answer: the label is the reward's
    with pytest.raises(ValueError, match=r"f:3: no assistant turn and no 'label'"):
        chat_messages(PromptRow(messages=[{"role": "user", "content": "a"}]), "f:3")


def test_bad_row_names_its_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "1+1="}], "label": "2"}\n'
                    '{"messages": [{"role": "robot", "content": "x"}], "label": "2"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: messages\[0\] has role 'robot'"):
        load_examples(str(path), tokenizer)


def test_batches_are_distinct_rows_from_a_seeded_stream_that_a_resumed_run_continues():
    batches = list(itertools.islice(iterate_batches(num_rows=10, batch_size=4, seed=3), 6))
    assert all(len(set(rows)) == 4 and set(rows) <= set(range(10)) for rows in batches)
    assert len({tuple(rows) for rows in batches}) == 6
    resumed = list(itertools.islice(iterate_batches(num_rows=10, batch_size=4, seed=3, first_step=4), 3))
    assert resumed == batches[3:]
    assert next(iterate_batches(num_rows=10, batch_size=4, seed=4)) != batches[0]
    # The demo's warm start always drew its batches this way: random.Random(seed).sample each step.
    rng = random.Random(3)
    assert [rng.sample(range(10), 4) for _ in range(6)] == batches


def test_settings_ignore_rl_fields_but_not_sft_ones():
    cfg = MoltConfig()
    base = sft_settings(cfg)
    cfg.train.num_steps, cfg.rollout.prompts_per_step = 7, 3
    assert sft_settings(cfg) == base
    cfg.sft.batch_size = 5
    assert sft_settings(cfg) != base


def test_settings_change_when_the_base_model_or_the_data_is_rewritten_in_place(tmp_path):
    """A warm start from a regenerated base model or data file (same path, new contents) is out of date."""
    import os

    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"0" * 8)
    cfg = MoltConfig()
    cfg.model.path = str(tmp_path)
    before = sft_settings(cfg)
    assert sft_settings(cfg) == before
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert sft_settings(cfg) != before
    # So is one from a data file rewritten in place.
    data = tmp_path / "rows.jsonl"
    data.write_text("{}\n")
    cfg.sft.data_path = str(data)
    before = sft_settings(cfg)
    data.write_text("{}\n{}\n")
    assert sft_settings(cfg) != before


def _one_step(rank: int, world_size: int, model_dir: str, rows: list[dict], packing: bool) -> dict:
    import torch.distributed as dist

    from molt.distributed.parallelize import TrainerMesh
    from molt.sft import train_step
    from molt.trace.experience import Experience
    from molt.trainer.batch import build_windows, share_step_batch
    from molt.trainer.policy import build_policy

    cfg = MoltConfig()
    cfg.model.path, cfg.train.packing = model_dir, packing
    cfg.train.learning_rate, cfg.train.weight_decay, cfg.train.max_grad_norm = 1e-2, 0.01, 0.0
    mesh = TrainerMesh.from_group(dist.group.WORLD, "cpu")
    policy = build_policy(cfg, mesh=mesh, device=torch.device("cpu"), num_steps=1)  # as molt.sft builds it
    examples = [Experience(token_ids=ids, action_mask=mask, behavior_logprobs=[0.0] * len(ids),
                           policy_versions=[0] * len(ids), reward=0.0, score=0.0, group_id=i, rollout_id=i)
                for i, (ids, mask) in enumerate(rows)]
    layout = policy.micro_batch_layout
    assert layout == ("rows" if packing else "padded")  # sdpa on CPU: rows as wide as the longest experience
    shares, counts = share_step_batch(examples, num_ranks=world_size, num_windows=1, max_tokens_per_micro_batch=48,
                                      layout=layout)
    micro_batches = build_windows([examples[i] for i in shares[rank]], num_windows=1, micro_batch_counts=counts,
                                  max_tokens_per_micro_batch=48, pad_token_id=policy.pad_token_id, layout=layout)[0]
    metrics = train_step(policy.actor, micro_batches, aux_loss_coef=0.0)
    weights = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for name, p in policy.actor.model.named_parameters()}
    return {"metrics": metrics, "weights": weights, "num_micro_batches": len(micro_batches)}


@pytest.mark.parametrize("packing", [False, True])
def test_one_step_matches_a_naive_hugging_face_step(tiny_model_dir, tokenizer, packing):
    """Two gloo ranks, several micro-batches each, on the actor molt.sft builds (build_policy): the
    loss is the token mean of the whole batch's assistant tokens (plain cross-entropy, one row at a
    time here) and the step is plain AdamW on its gradient."""
    rows = []
    for a in range(8):
        messages = [{"role": "user", "content": f"{a}+{a + 1}="}, {"role": "assistant", "content": str(2 * a + 1)}]
        if a % 3 == 0:
            messages += [{"role": "user", "content": "again"}, {"role": "assistant", "content": str(2 * a + 1)}]
        rows.append(tokenize_chat(tokenizer, messages))
    results = run_ranks(_one_step, 2, str(tiny_model_dir), rows, packing)
    assert all(result["num_micro_batches"] > 1 for result in results)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    nll, count = torch.zeros((), dtype=torch.float64), 0
    for ids, mask in rows:  # unpadded, one row at a time
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        for t in range(1, len(ids)):
            if mask[t]:
                nll = nll - torch.log_softmax(logits[t - 1].double(), dim=-1)[ids[t]]
                count += 1
    loss = nll / count
    loss.backward()
    optimizer.step()
    for result in results:
        assert result["metrics"]["loss"] == pytest.approx(loss.item(), rel=1e-5)
        assert result["metrics"]["tokens"] == count
        for name, expected in model.named_parameters():
            torch.testing.assert_close(result["weights"][name], expected.detach(), rtol=1e-4, atol=1e-4)


def _run_sft(args: list[str], nproc: int = 0, timeout_seconds: float = 300) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc else [sys.executable])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(launcher + ["-m", "molt.sft", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=REPO, env=env, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout_seconds)
    except BaseException:  # a timeout, the test's own limit: no job outlives the test
        os.killpg(process.pid, 9)
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _corpus_loss(model_dir, tokenizer, examples) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nll, count = 0.0, 0
    with torch.no_grad():
        for example in examples:
            logprobs = torch.log_softmax(model(input_ids=torch.tensor([example.token_ids])).logits[0].double(), -1)
            for t in range(1, example.num_tokens):
                if example.action_mask[t]:
                    nll -= logprobs[t - 1, example.token_ids[t]].item()
                    count += 1
    return nll / count


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_sft_on_two_torchrun_ranks_lowers_the_loss_and_writes_a_loadable_model(
        tmp_path, tiny_model_dir, demo_data_dir, tokenizer):
    """The demo's warm-start recipe, shortened, on 2 gloo ranks: the loss falls, a checkpoint is
    written midway, the model directory loads with transformers and scores the rows better than the
    base model; a second call with the same settings does nothing."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(line + "\n" for line in (demo_data_dir / "train.jsonl").read_text().splitlines()[:256]))
    out = tmp_path / "model"
    args = ["--config", "configs/demo.py:sft", "--set", f"model.path={tiny_model_dir}",
            "--set", f"sft.data_path={rows}",
            "--set", f"sft.output_dir={out}", "--set", "sft.num_steps=24", "--set", "sft.batch_size=32",
            "--set", f"metrics.output_dir={tmp_path / 'run'}", "--set", "checkpoint.interval_steps=12"]
    job = _run_sft(args, nproc=2)
    assert job.returncode == 0, job.stderr[-4000:]
    record = json.loads((out / "sft.json").read_text())
    summary = record["summary"]
    assert summary["ranks"] == 2 and summary["steps"] == 24 and len(summary["losses"]) == 24
    losses = summary["losses"]
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4, losses
    assert (tmp_path / "run" / "checkpoints" / "step_00000012" / "COMPLETE").is_file()
    examples = load_examples(str(rows), tokenizer)[:64]
    assert _corpus_loss(out, tokenizer, examples) < 0.5 * _corpus_loss(tiny_model_dir, tokenizer, examples)
    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template

    again = _run_sft(args)  # one process: the same settings, so nothing to do
    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr[-2000:]
    assert json.loads((out / "sft.json").read_text()) == record
