"""tierflow inside Hugging Face's Trainer (``TierflowCallback``): a tiny GPT-2 built from a
config (nothing downloaded), trained by ``transformers.Trainer`` with and without the
callback on the CPU, with dropout, gradient accumulation and evaluation steps: the same
losses, evaluation losses and final parameters bit for bit, and bytes really moved."""

from __future__ import annotations

import copy
import time
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it on torch

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from tierflow.integrations.transformers import TierflowCallback  # noqa: E402

SEED = 0
STEPS = 6
EVAL_EVERY = 2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(SEED)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                     bos_token_id=0, eos_token_id=0)
    assert cfg.resid_pdrop > 0 and cfg.attn_pdrop > 0  # dropout on: the RNG stream must match too
    return GPT2LMHeadModel(cfg)


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, 128, (n, 16), generator=g)]


def _train(base, tmp_path, callbacks, *, eval_strategy="steps", save_strategy="no"):
    """One Trainer run from a copy of ``base``; returns (log_history, model)."""
    transformers.set_seed(SEED)
    model = copy.deepcopy(base)
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, seed=SEED, data_seed=SEED,
        max_steps=STEPS, gradient_accumulation_steps=2, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, eval_strategy=eval_strategy, eval_steps=EVAL_EVERY,
        save_strategy=save_strategy, save_steps=3, logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, learning_rate=1e-3,
    )
    trainer = Trainer(model=model, args=args, train_dataset=_data(64, 1), eval_dataset=_data(8, 2),
                      callbacks=callbacks)
    trainer.train()
    return trainer.state.log_history, model


def _assert_same(plain, tiered):
    (log_a, model_a), (log_b, model_b) = plain, tiered
    keys = ("loss", "grad_norm", "eval_loss")
    a = [(h["step"], k, h[k]) for h in log_a for k in keys if k in h]
    b = [(h["step"], k, h[k]) for h in log_b for k in keys if k in h]
    assert a == b  # floats compared exactly
    assert any(k == "eval_loss" for _, k, _ in a)
    for (name, p), (_, q) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(p, q), name


def test_trainer_with_callback_is_bitwise_plain_trainer(base_model, tmp_path):
    plain = _train(base_model, tmp_path / "plain", [])
    # myelin makes a planned plan here (tierflow's closed loop may pick a reactive one,
    # which has no op order to depart from): every step after the profile is checked
    cb = TierflowCallback(budget="70%", policy="myelin")
    tiered = _train(base_model, tmp_path / "tiered", [cb])
    _assert_same(plain, tiered)
    assert cb.run is None and len(cb.runs) == 1  # entered at train begin, left at train end
    st = cb.runs[0].stats
    assert st.steps == STEPS  # one iteration per optimizer step: 2 micro-batches each, no eval
    assert st.moved_bytes["host"] > 0 and st.planned_moves > 0
    # evaluation ran under torch.no_grad() between steps, untracked: not profiled, no departure
    # (the warm-up, while AdamW has no state yet, is recorded too; the Trainer's default
    # fused AdamW holds most of this small model's bytes, so once the 70% budget is known
    # its step runs in chunks, profiled once more: three recorded, one plan)
    assert st.optimizer_chunks > 1
    assert st.profiled_steps == 3 and st.replans == 1 and st.stale_plans == 0
    assert st.planned_steps == STEPS - 3 and st.reactive_steps == 0


def test_trainer_callback_with_ssd_and_a_checkpoint(base_model, tmp_path):
    plain = _train(base_model, tmp_path / "plain", [], save_strategy="steps")
    (tmp_path / "ssd").mkdir()
    cb = TierflowCallback(budget="70%", policy="tierflow", ssd_dir=tmp_path / "ssd",
                          host_bytes=256 << 10)
    tiered = _train(base_model, tmp_path / "tiered", [cb], save_strategy="steps")
    _assert_same(plain, tiered)
    # the checkpoint at step 3 closed the run (every tensor home to be serialised); a new
    # one opened at the next step
    assert len(cb.runs) == 2 and cb.run is None
    assert sum(r.stats.steps for r in cb.runs) == STEPS
    assert sum(r.stats.moved_bytes["ssd"] for r in cb.runs) > 0
    saved = torch.load(tmp_path / "tiered" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    want = torch.load(tmp_path / "plain" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    for k, state in want["state"].items():
        for key, v in state.items():
            assert torch.equal(saved["state"][k][key], v), (k, key)


def test_close_brings_everything_home_after_a_failed_train(base_model):
    model = copy.deepcopy(base_model)
    opt = torch.optim.AdamW(model.parameters())
    cb = TierflowCallback(budget="70%")
    cb.on_train_begin(None, None, None, model=model, optimizer=opt)
    x = _data(4, 3)[0]["input_ids"][None].repeat(4, 1)
    for _ in range(4):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    before = cb.run.stats.moved_bytes["host"]
    cb.close()  # what a user calls when trainer.train() raised
    assert before > 0 and cb.run is None
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())


def test_an_evaluation_between_steps_begins_no_iteration(base_model, monkeypatch):
    # what the Trainer does between two steps: evaluate under no_grad, then load the next
    # batches (the DataLoader runs a record_function op) before the next forward
    # (the evaluation "takes" 100 s on the runtime's clock, which is the real one plus
    # what the test adds: a step that counted it would be over 100 s, however loaded the
    # machine is, and no test sleeps)
    from tierflow.runtime import executor

    added = [0.0]
    monkeypatch.setattr(executor, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + added[0]))
    model = copy.deepcopy(base_model)
    opt = torch.optim.AdamW(model.parameters())
    x = _data(4, 3)[0]["input_ids"][None].repeat(4, 1)

    def step():
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    cb = TierflowCallback(budget="70%", policy="myelin")  # a planned plan: its op order is checked
    cb.on_train_begin(None, None, None, model=model, optimizer=opt)
    try:
        for _ in range(3):  # warm-up, profile, one planned step
            step()
        cb._enter_evaluation()
        with torch.no_grad():
            model(input_ids=x)
        added[0] += 100.0  # a long evaluation
        cb._leave_evaluation()
        with torch.autograd.profiler.record_function("data"):
            torch.ones(4, 16, dtype=torch.long)
        step()
        st = cb.run.stats
        assert not cb.run.plan.reactive
        assert st.stale_plans == 0 and st.planned_steps == 2
        assert st.step_times_s[-1] < 100.0  # the evaluation is not the step's
    finally:
        cb.close()


def _plain_loop(base, steps, run_kw=None):
    """A plain PyTorch loop over the Hugging Face GPT-2 (dropout on), optionally under
    ``tierflow.offload``: losses, final parameters, optimizer state."""
    import tierflow

    model = copy.deepcopy(base)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(SEED)
    losses = []
    ctx = tierflow.offload(model, opt, **run_kw) if run_kw else None
    run = ctx.__enter__() if ctx else None
    try:
        for _ in range(steps):
            x = torch.randint(0, 128, (8, 16), generator=g)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    return model, opt, losses, run


def test_hf_gpt2_with_dropout_under_tierflow_at_40pct_is_bitwise(base_model):
    ref = _plain_loop(base_model, 12)
    got = _plain_loop(base_model, 12, dict(budget="40%", policy="tierflow"))
    (ma, oa, la, run), (mb, ob, lb, _) = got, ref
    assert la == lb
    for (name, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert torch.equal(p, q), name
        for k, v in ob.state[q].items():
            assert torch.equal(oa.state[p][k], v), (name, k)
    s = run.stats
    assert s.policy == "tierflow" and s.plan_error is None and s.planned_steps >= 8
    assert s.peak_device_bytes <= s.budget_bytes and sum(s.moved_bytes.values()) > 0
