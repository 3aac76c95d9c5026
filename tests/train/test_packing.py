"""Packed micro-batches (`pipeline.planning.packing`, `pipeline.model.batch`): best-fit decreasing rows,
the same micro-batch count on every rank, records kept apart in a row (each record's loss equals its
padded loss within 1e-6 in fp32, for every family listed as packable), where packing is on or off and
why, the plan's padding report, and that a packed run trains what a padded one does up to the order of
the sums. The run-level guarantees with packing (chunked == one run bitwise, SIGKILL / preemption
resume, DDP, FSDP, fp16) are tests/train/test_exact_resume.py, test_fsdp.py and
test_half_precision.py, which train on `tiny_mixed`: records that pack several to a row."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from kits import lm
from kits.moe import ROUTER_LOSS
from kits.train import make_run, step_losses

from pipeline.data.cache import IGNORE_INDEX, TokenCache
from pipeline.errors import UserError
from pipeline.model.batch import RECORD_BOUNDS, collate, collate_rows
from pipeline.model import packed_attention
from pipeline.config import MoeConfig
from pipeline.model import router, row_masks
from pipeline.model.loss import MASK_FREE_FAMILIES, TokenLoss
from pipeline.planning import packing
from pipeline.planning.order import RunSampler
from pipeline.planning.packing import PACKABLE_FAMILIES, Packing, best_fit_decreasing, decide, pack_update


# --- best-fit decreasing and the update's layout -------------------------------------------------


def test_best_fit_decreasing_puts_each_record_in_the_fullest_row_it_fits():
    # 5 -> row 0 (1 left); 4 -> row 1 (2 left); 3 -> row 2 (3 left); 3 -> row 2, the only one with
    # room; 2 -> row 1 (fits exactly); 1 -> row 0
    assert best_fit_decreasing([5, 4, 3, 3, 2, 1], 6) == [[0, 5], [1, 4], [2, 3]]
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing([7], 6)


@pytest.mark.parametrize("world,micro", [(1, 1), (1, 4), (2, 1), (2, 3), (4, 2)])
def test_every_rank_gets_the_same_number_of_micro_batches_of_whole_records(world, micro):
    rng = random.Random(world * 10 + micro)
    lengths = np.array([rng.randint(4, 96) for _ in range(500)])
    for trial in range(40):
        batch = world * micro * rng.choice([1, 2, 3, 8])  # as the trainer checks: ranks x micro-batch x accumulation
        indices = rng.sample(range(len(lengths)), batch)
        if trial % 4 == 0:  # all short: few rows, which must be split for the ranks' micro-batches
            indices = [int(i) for i in np.flatnonzero(lengths < 20)[:batch]]
        shares = pack_update(indices, lengths, capacity=96, world=world, micro=micro)
        assert len(shares) == world and len({len(share) for share in shares}) == 1
        rows = [row for share in shares for mb in share for row in mb]
        assert sorted(i for row in rows for i in row) == sorted(indices)  # each record once
        assert all(1 <= len(mb) <= micro for share in shares for mb in share)  # no empty micro-batch anywhere
        assert all(lengths[row].sum() <= 96 for row in rows)
        for share in shares:  # longest rows first: the first micro-batch is the largest
            widths = [int(lengths[row].sum()) for mb in share for row in mb]
            assert widths == sorted(widths, reverse=True)
        assert pack_update(indices, lengths, capacity=96, world=world, micro=micro) == shares  # a pure function
        # what a micro-batch holds does not depend on the ranks: one process runs them all, in the same places
        alone = pack_update(indices, lengths, capacity=96, world=1, micro=micro)[0]
        assert [shares[j % world][j // world] for j in range(len(alone))] == alone
        assert len(alone) == -(-batch // micro)  # as many micro-batches as padded


def test_packing_halves_the_padding_of_micro_batches_grouped_by_length():
    rng = np.random.default_rng(0)
    lengths = rng.integers(32, 513, 4000)
    sampler = RunSampler(len(lengths), 32, seed=0, lengths=lengths)
    report = packing.padding_report(sampler, lengths, range(50), capacity=512, world=2, micro=8, layout="rows")
    assert report["after"] < 0.08 and report["after"] < report["before"] / 2, report  # before: grouped by length
    assert packing.padding_report(sampler, lengths, range(5), capacity=512, world=1, micro=8,
                                  layout="flat")["after"] == 0.0


# --- where packing is on, and why not elsewhere ----------------------------------------------------


def test_auto_packs_checked_text_families_and_says_why_not_elsewhere():
    assert decide("auto", implementation="sdpa", model_type="llama", vision_language=False).layout == "rows"
    cpu = decide("auto", implementation="sdpa", model_type="llama", vision_language=False, device="cpu",
                 per_record=True)
    assert cpu.layout == "records" and cpu.per_record  # SDPA record by record on a CPU, where the model can
    assert decide("auto", implementation="eager", model_type="llama", vision_language=False, device="cpu",
                  per_record=True).layout == "rows"
    assert decide("auto", implementation="flash_attention_2", model_type="qwen3", vision_language=False).layout == "flat"
    vlm = decide("auto", implementation="sdpa", model_type="qwen2_vl", vision_language=True)
    assert not vlm.on and "vision-language" in vlm.why
    unchecked = decide("auto", implementation="sdpa", model_type="qwen3_next", vision_language=False)
    assert not unchecked.on and "not checked" in unchecked.why
    assert decide("on", implementation="sdpa", model_type="qwen3_next", vision_language=False).on  # the user's call
    assert not decide("off", implementation="sdpa", model_type="llama", vision_language=False).on
    with pytest.raises(UserError, match="tokens.packing=on: models/vl is a vision-language model"):
        decide("on", implementation="sdpa", model_type="llava", vision_language=True, where="models/vl")
    with pytest.raises(UserError, match="'paged_attention'"):
        decide("on", implementation="paged_attention", model_type="llama", vision_language=False)


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h", "falcon_h1"])
def test_layers_that_carry_state_across_tokens_are_never_packed(family):
    """Linear attention and Mamba mixers run from one record of a row into the next, whatever the mask:
    `auto` keeps such a model's batches padded and says why, `on` is refused naming the setting."""
    config = lm.config(family)
    recurrent = packing.recurrent_layers(config)
    assert recurrent, family
    auto = decide("auto", implementation="sdpa", model_type=family, vision_language=False, recurrent=recurrent)
    assert not auto.on and "carry their state" in auto.why and recurrent in auto.why
    with pytest.raises(UserError, match=f"tokens.packing=on: models/{family}: its {recurrent} layers"):
        decide("on", implementation="sdpa", model_type=family, vision_language=False, recurrent=recurrent,
               where=f"models/{family}")
    assert packing.recurrent_layers(lm.config("qwen3_moe")) is None


# --- collation: records kept apart ------------------------------------------------------------------


def test_packed_rows_restart_positions_per_record_and_for_the_padding(tiny_mixed):
    cache = TokenCache(tiny_mixed["train"])
    rows = [[0, 1], [2]]
    batch = collate_rows(cache, rows, pad_id=0, layout="rows")
    ids, pos = batch.inputs["input_ids"], batch.inputs["position_ids"]
    assert "attention_mask" not in batch.inputs
    width = ids.shape[1]
    assert width == max(sum(len(cache[i][0]) for i in row) for row in rows)
    ends = set()
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            tokens = cache[i][0]
            n = len(tokens)
            assert torch.equal(ids[r, offset:offset + n], tokens) and torch.equal(pos[r, offset:offset + n],
                                                                                  torch.arange(n))
            ends.add(r * width + offset + n - 1)
            offset += n
        assert torch.equal(pos[r, offset:], torch.arange(width - offset))  # the padding: a record of its own
    assert not ends & set(batch.loss_index.tolist())  # no target crosses into the next record
    assert torch.equal(batch.targets, ids.flatten()[batch.loss_index + 1])
    assert batch.supervised == sum(int((cache[i][1][1:] != IGNORE_INDEX).sum()) for row in rows for i in row)
    # rows of one record each: nothing to keep apart, the padded batch itself
    single = collate_rows(cache, [[3], [4]], pad_id=0, layout="rows")
    assert single.inputs.keys() == collate(cache, [3, 4], pad_id=0).inputs.keys()
    assert torch.equal(single.inputs["input_ids"], collate(cache, [3, 4], pad_id=0).inputs["input_ids"])
    # flash-attention's layout: one row, no padding, the boundaries given
    flat = collate_rows(cache, rows, pad_id=0, layout="flat")
    assert torch.equal(flat.inputs["input_ids"], collate(cache, [0, 1, 2], pad_id=0, packed=True).inputs["input_ids"])
    # SDPA record by record (a CPU): the same row, its boundaries as ints (nothing to read back from a tensor)
    records = collate_rows(cache, rows, pad_id=0, layout="records")
    assert torch.equal(records.inputs["input_ids"], flat.inputs["input_ids"]) and "cu_seq_lens_q" not in records.inputs
    assert records.inputs[RECORD_BOUNDS] == tuple(flat.inputs["cu_seq_lens_q"].tolist())


def _family(family: str, implementation: str, window: int = 4):
    """A tiny random `family` model (tests/kits/lm.py); `window`: its sliding window, if it has one (4: shorter
    than the records, so a sliding mask is packed too)."""
    return lm.model(family, implementation, window=window)


def _records(lengths=(11, 7, 4, 9, 13, 3)):
    g = torch.Generator().manual_seed(1)
    records = []
    for n in lengths:
        ids = torch.randint(1, lm.VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[:2] = IGNORE_INDEX  # a prompt
        records.append((ids, labels))
    return records


def _per_record_losses(model, batch, counts) -> torch.Tensor:
    """Mean next-token loss of each record of `batch` (its supervised tokens `counts`, in batch order); the
    inputs as `TokenLoss` gives them (GPT-OSS's packed rows with their masks, `pipeline.model.row_masks`)."""
    hidden = model.base_model(**row_masks.with_row_masks(model, batch.inputs), use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden.flatten(0, 1)[batch.loss_index]).float()
    losses = torch.nn.functional.cross_entropy(logits, batch.targets, reduction="none")
    return torch.stack([part.mean() for part in losses.split(counts)])


# every family the list names, with both mask-building implementations a CPU runs (transformers runs
# Gemma-2, GPT-OSS, HunYuan V4, Granite SWA and VaultGemma with eager attention only)
EAGER_ONLY = {"gemma2", "gpt_oss", "hy_v4", "granite_swa", "vaultgemma"}
CASES = [(f, i) for f in sorted(PACKABLE_FAMILIES) for i in ("sdpa", "eager") if i == "eager" or f not in EAGER_ONLY]
# mixtures of experts with a load-balancing loss beyond `kits.moe`'s (built by `kits.lm` with 4 experts)
ROUTED = set(ROUTER_LOSS) | {"laguna", "mellum", "qwen2_moe", "ernie4_5_moe", "granitemoe", "minimax_m2", "flex_olmo"}


@pytest.mark.parametrize("family,implementation", CASES)
def test_each_packed_record_has_its_padded_loss(family, implementation):
    model = _family(family, implementation).eval()
    cache = _records()
    rows = [[0, 2], [4], [1, 3, 5]]  # 15, 13 and 19 tokens: packed rows of several records and padding
    order = [i for row in rows for i in row]
    counts = [int((cache[i][1][1:] != IGNORE_INDEX).sum()) for i in order]
    with torch.no_grad():
        packed = _per_record_losses(model, collate_rows(cache, rows, 0, "rows"), counts)
        padded = _per_record_losses(model, collate(cache, order, 0), counts)
    assert (packed - padded).abs().max() < 1e-6, (packed - padded).abs().max()


@pytest.mark.parametrize("family", sorted(PACKABLE_FAMILIES & MASK_FREE_FAMILIES))
def test_each_record_attended_on_its_own_has_its_padded_loss(family):
    """The CPU path: one flat row, SDPA's causal kernel record by record (`packed_attention`)."""
    model = _family(family, "sdpa", window=16).eval()  # a window (Mistral's) covering the records
    cache = _records()
    assert packed_attention.runs_per_record(model.config, max(len(ids) for ids, _ in cache))
    rows = [[0, 2], [4], [1, 3, 5]]
    order = [i for row in rows for i in row]
    counts = [int((cache[i][1][1:] != IGNORE_INDEX).sum()) for i in order]
    with torch.no_grad():
        padded = _per_record_losses(model, collate(cache, order, 0), counts)
        packed_attention.use(model)
        flat = _per_record_losses(model, collate_rows(cache, rows, 0, "records"), counts)
        without_mask = _per_record_losses(model, collate(cache, order, 0), counts)  # validation's padded batches
    assert (flat - padded).abs().max() < 1e-6, (flat - padded).abs().max()
    assert (without_mask - padded).abs().max() < 1e-6


def _attend_each_sequence(query, key, value, bounds, *, causal: bool, scale: float | None, grouped: bool):
    """What torch documents for `torch.nn.attention.varlen.varlen_attn`, written out: query (T, Hq, D),
    key / value (T, Hkv, D); each sequence of `bounds` attends within itself; query head h reads K/V head
    h // (Hq / Hkv) (GQA); softmax(q k^T x scale) v, scale 1 / sqrt(D) by default. Its kernel needs CUDA."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
    assert kv_heads == heads or grouped, "different K/V heads without GQA asked for"
    kv = torch.arange(heads) // (heads // kv_heads)
    out = torch.empty_like(query)
    for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        q, k, v = query[s:e].transpose(0, 1), key[s:e, kv].transpose(0, 1), value[s:e, kv].transpose(0, 1)
        scores = q @ k.transpose(1, 2) * (dim ** -0.5 if scale is None else scale)
        if causal:
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


# The signatures torch's varlen_attn has had: 2.10 (a causal flag, no scale, no GQA) and 2.11 on.
def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32 and max_q == max_k
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    return _attend_each_sequence(query, key, value, cu_seq_q, causal=is_causal, scale=None, grouped=False)


def _varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32 and max_q == max_k
    assert tuple(window_size) in ((-1, -1), (-1, 0)), window_size
    return _attend_each_sequence(query, key, value, cu_seq_q, causal=tuple(window_size) == (-1, 0), scale=scale,
                                 grouped=enable_gqa)


@pytest.mark.parametrize("kernel", [_varlen_2_10, _varlen_2_13], ids=["torch-2.10", "torch-2.13"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])  # grouped K/V heads; Gemma 3's own attention scale
def test_torch_varlen_path_gives_each_record_its_padded_loss_and_gradients(family, kernel, monkeypatch):
    """The GPU path of `tokens.torch_varlen` on a CPU: torch's varlen kernel has no CPU implementation, so
    `packed_attention` is handed a written-out one of the same signature (either torch's), and the flat
    row's per-record losses and gradients must be the padded batch's."""
    monkeypatch.setattr(packed_attention, "torch_varlen_kernel", lambda: kernel)
    monkeypatch.setattr(packed_attention, "_KERNEL", None)  # `use` reads the kernel's signature once
    model = _family(family, "sdpa", window=16)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    cache = _records()
    rows = [[0, 2], [4], [1, 3, 5]]
    order = [i for row in rows for i in row]
    counts = [int((cache[i][1][1:] != IGNORE_INDEX).sum()) for i in order]
    padded = _per_record_losses(model, collate(cache, order, 0), counts)
    grads = torch.autograd.grad(padded.sum(), [p for p in model.parameters() if p.requires_grad])
    packed_attention.use(model)
    batch = collate_rows(cache, rows, 0, "flat")
    assert batch.inputs["cu_seq_lens_q"].tolist() == [0, 11, 15, 28, 35, 44, 47]
    flat = _per_record_losses(model, batch, counts)
    flat_grads = torch.autograd.grad(flat.sum(), [p for p in model.parameters() if p.requires_grad])
    assert (flat - padded).abs().max() < 1e-6, (flat - padded).abs().max()
    assert max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(flat_grads, grads)) < 1e-5



def test_a_flat_batch_without_torchs_varlen_kernel_stops_naming_the_setting(monkeypatch):
    """A torch without `torch.nn.attention.varlen` (< 2.10) never gets a flat batch from the plan; one that
    reaches the switched model anyway stops with the reason, not with a NoneType call deep in a layer."""
    monkeypatch.setattr(packed_attention, "torch_varlen_kernel", lambda: None)
    model = _family("llama", "sdpa", window=16)
    packed_attention.use(model)
    with pytest.raises(RuntimeError, match=r"no torch.nn.attention.varlen .*tokens.torch_varlen"):
        model(**collate_rows(_records(), [[0, 2]], 0, "flat").inputs)

def test_torch_varlen_is_asked_for_and_says_where_it_does_not_fit(monkeypatch):
    import transformers as tf

    fits = packed_attention.varlen_fits
    monkeypatch.setattr(packed_attention, "torch_varlen_kernel", lambda: _varlen_2_13)
    llama = tf.LlamaConfig(hidden_size=64, num_attention_heads=4)  # head size 16
    assert fits(llama, torch.bfloat16) is None and fits(llama, torch.float16) is None
    assert "bf16 or fp16" in fits(llama, None) and "bf16 or fp16" in fits(llama, torch.float32)
    assert "head size 12" in fits(tf.LlamaConfig(hidden_size=48, num_attention_heads=4), torch.bfloat16)
    assert "head size 320" in fits(tf.LlamaConfig(hidden_size=640, num_attention_heads=2), torch.bfloat16)
    assert "no dropout" in fits(tf.LlamaConfig(hidden_size=64, num_attention_heads=4, attention_dropout=0.1),
                                torch.bfloat16)
    assert "soft-capped" in fits(tf.Gemma2Config(), torch.bfloat16)
    # Gemma 4's config sets head_dim per layer (512 in its full-attention layers): the global read raises
    gemma4 = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    assert "head size 512" in fits(tf.Gemma4TextConfig(**gemma4, head_dim=256), torch.bfloat16)
    assert fits(tf.Gemma4TextConfig(**gemma4, head_dim=128, global_head_dim=256), torch.bfloat16) is None
    monkeypatch.setattr(packed_attention, "torch_varlen_kernel", lambda: None)
    assert "torch >= 2.10" in fits(llama, torch.bfloat16)

    common = dict(implementation="sdpa", model_type="llama", vision_language=False, per_record=True)
    gpu = decide("auto", **common, device="cuda", varlen=True)
    assert (gpu.layout, gpu.per_record, gpu.why) == ("flat", True, packing.GPU_VARLEN[1])
    rows = decide("auto", **common, device="cuda")  # off: the default; the plan says what it would gain
    assert rows.layout == "rows" and rows.why.endswith(packing.VARLEN_HINT) and "2x at 4096" in rows.why
    assert not decide("auto", **common, device="cuda", varlen_unfit="bf16 only").why.endswith(packing.VARLEN_HINT)
    assert not decide("auto", **{**common, "per_record": False}, device="cuda").why.endswith(packing.VARLEN_HINT)
    assert decide("auto", **common, device="cpu", varlen=True).layout == "records"  # a CPU attends record by record
    unfit = decide("on", **common, device="cuda", varlen=True, varlen_unfit="its flash kernel computes in bf16")
    assert unfit.layout == "rows" and unfit.why.endswith("tokens.torch_varlen not used: its flash kernel computes "
                                                         "in bf16") and not unfit.per_record
    masked = decide("auto", **{**common, "per_record": False}, device="cuda", varlen=True)
    assert masked.layout == "rows" and "does not attend record by record" in masked.why
    flash = decide("auto", **{**common, "implementation": "flash_attention_2"}, device="cuda", varlen=True)
    assert flash == Packing("flat", packing.PATHS["flash_attention_2"][1])  # flash-attn's own kernel


@pytest.mark.parametrize("family", sorted(PACKABLE_FAMILIES & ROUTED))
def test_a_mixture_of_experts_balances_the_real_tokens_of_packed_rows(family):
    """The load-balancing loss of a packed micro-batch is its padded batch's: both count the real tokens
    only (a packed row's padding, which no attention mask marks, left out by `Batch.real`); and so is the
    whole training loss of the micro-batch, through `TokenLoss` (GPT-OSS: with the masks it is given)."""
    model = _family(family, "eager" if family in EAGER_ONLY else "sdpa")  # training: the loss adds the router's term
    router.enable_router_loss(model, MoeConfig())
    loss_model = TokenLoss(model)
    cache = _records()
    rows = [[0, 2], [4], [1, 3, 5]]  # rows of 15, 13 and 19 tokens: the first two padded to 19
    packed, padded = collate_rows(cache, rows, 0, "rows"), collate(cache, [i for row in rows for i in row], 0)
    assert packed.real is not None and int(packed.real.sum()) == packed.tokens < packed.real.numel()
    losses, sums = [], []
    for batch in (packed, padded):
        losses.append(loss_model(batch).detach())  # cross-entropy sum + coef x balancing loss x supervised
        sums.append(loss_model.take_router_sum())
    if router.records_router_logits(model):
        assert sums[0] > 0 and torch.allclose(sums[0], sums[1], rtol=1e-6, atol=0), sums
    else:  # transformers 5.17's GraniteMoE returns no router logits: cross-entropy alone (test_router_loss.py)
        assert sums == [None, None], sums
    assert torch.allclose(losses[0], losses[1], rtol=1e-6, atol=0), losses


def test_a_sliding_window_shorter_than_the_records_keeps_its_mask():
    import transformers as tf

    config = tf.MistralConfig(sliding_window=16)
    assert packed_attention.runs_per_record(config, 16) and not packed_attention.runs_per_record(config, 17)
    assert packed_attention.runs_per_record(tf.Qwen2Config(sliding_window=4, use_sliding_window=False), 64)
    assert packed_attention.runs_per_record(tf.Gemma3TextConfig(sliding_window=8), 8)
    assert not packed_attention.runs_per_record(tf.Gemma3TextConfig(sliding_window=8), 9)
    assert not packed_attention.runs_per_record(tf.Glm4Config(), 8)  # not a mask-free family


def test_packed_loss_and_gradients_equal_the_padded_ones_in_fp32():
    """TokenLoss, the training path: the summed loss and every gradient of a packed micro-batch."""
    model = _family("llama", "sdpa")
    loss_model = TokenLoss(model)
    cache = _records()
    rows = [[0, 2], [4], [1, 3, 5]]

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        loss = loss_model(batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    packed = loss_and_grads(collate_rows(cache, rows, 0, "rows"))
    padded = loss_and_grads(collate(cache, [i for row in rows for i in row], 0))
    assert torch.allclose(packed[0], padded[0], rtol=1e-6, atol=0)
    for a, b in zip(packed[1], padded[1]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# --- runs -----------------------------------------------------------------------------------------


def test_plan_prints_the_path_and_the_padding_before_and_after(tiny_mixed, tmp_path, capsys):
    run = make_run(tmp_path / "on", tiny_mixed, total=6)
    out = capsys.readouterr().out
    assert "packing: on, SDPA with a block-causal mask" in out and "on a CPU: SDPA's causal kernel record by" in out
    assert "tokens.torch_varlen=true would train one flat row per micro-batch without the mask" in out
    assert "rows of up to 95 tokens" in out
    report = json.loads(run.plan.read_text())["packing"]
    assert report["layout"] == {"gpu": "rows", "cpu": "records"} and report["padding_rows"] < report["padding_before"]
    assert (f"{report['padding_before']:.1%} of the tokens computed in padded micro-batches, packed: "
            f"{report['padding_rows']:.1%} in packed rows, none in one flat row") in out
    make_run(tmp_path / "off", tiny_mixed, total=6, overrides=["tokens.packing=off"])
    assert "packing: off: tokens.packing=off" in capsys.readouterr().out
    # tokens.torch_varlen: a GPU (bf16 there by default) would run one flat row through torch's varlen
    # kernel, a CPU as before; asked for under fp32, the plan says why a GPU would not.
    varlen = make_run(tmp_path / "varlen", tiny_mixed, total=6, overrides=["tokens.torch_varlen=true"])
    out = capsys.readouterr().out
    assert "packing: on, torch's flash-attention varlen kernel" in out and "on a CPU: SDPA's causal kernel" in out
    assert json.loads(varlen.plan.read_text())["packing"]["layout"] == {"gpu": "flat", "cpu": "records"}
    make_run(tmp_path / "fp32", tiny_mixed, total=6, overrides=["tokens.torch_varlen=true", "precision.mode=fp32"])
    assert "tokens.torch_varlen not used: its flash kernel computes in bf16 or fp16 only" in capsys.readouterr().out


def test_packing_changes_only_the_order_of_the_sums(tiny_mixed, tmp_path):
    """The same run three ways: packed in one flat row attended record by record (SDPA on a CPU, the
    default here), packed in rows with a block-causal mask (eager attention), padded."""
    base = ["lora.dropout=0.0"]  # dropout masks are drawn per micro-batch layout: compare without them
    runs = {"records": ([], "packing: on, SDPA's causal kernel record by record"),
            "rows": (["model.attn_implementation=eager"], "packing: on, eager attention with a block-causal mask"),
            "padded": (["tokens.packing=off"], "packing: off")}
    losses = {}
    for name, (overrides, said) in runs.items():
        run = make_run(tmp_path / name, tiny_mixed, total=6, single_stage=True, overrides=[*base, *overrides])
        assert said in run.train("all").stdout
        losses[name] = step_losses([run.stage_dir("all")])
    assert [s for s, _ in losses["records"]] == [s for s, _ in losses["padded"]] == list(range(1, 7))
    for name in ("records", "rows"):
        assert [x for _, x in losses[name]] == pytest.approx([x for _, x in losses["padded"]], rel=1e-5)
