"""Qwen3.5's hybrid model (Gated DeltaNet + gated attention) matches transformers: whole prompts, chunked
prefill continuing from saved states, greedy decode (its decays kept in the states' scales or not), and mixed
batches; and its checkpoints load in both forms."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from rawserve.engine.attention.metadata import AttentionMetadata
from rawserve.engine.loader import CheckpointError, read_model_config
from rawserve.engine.models import delta_decode
from rawserve.engine.models.gated_delta import StateBatch
from rawserve.engine.models.qwen35 import load_qwen35_model
from rawserve.engine.models.vision import load_vision_tower
from rawserve.engine.quant import probe_plan
from rawserve.engine.step_plan import StepInput
from tests.qwen35_checkpoints import load_hf_qwen35, make_qwen35_checkpoint

BLOCK = 4
NUM_SLOTS = 6
CHUNK = 8  # the delta rule's chunk in these tests: prompts of 20-40 tokens then span several chunks


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def blocks_for(n: int, first: int = 0) -> list[int]:
    return [first + 2 * i + 1 for i in range(-(-n // BLOCK))]  # not 0..k in order: a wrong lookup shows


def attention_metadata(seqs: list[StepInput], block: int = BLOCK) -> tuple[AttentionMetadata, torch.Tensor]:
    """What ModelRunner._metadata builds for the torch backend (the runner itself builds a dense model today)."""
    starts, seq_lens, slots, positions, decode_tok, decode_seq, prefill_seq = [0], [], [], [], [], [], []
    for i, seq in enumerate(seqs):
        n, start = len(seq.token_ids), seq.num_computed_tokens
        for p in range(start, start + n):
            positions.append(p)
            slots.append(seq.block_table[p // block] * block + p % block)
        (decode_seq if n == 1 else prefill_seq).append(i)
        if n == 1:
            decode_tok.append(starts[-1])
        starts.append(starts[-1] + n)
        seq_lens.append(start + n)
    width = max(len(seq.block_table) for seq in seqs)
    tables = torch.tensor([seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs])
    lens = torch.tensor(seq_lens)
    max_decode = max((seq_lens[i] for i in decode_seq), default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=lens,
        block_tables=tables, query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
        decode_token_ids=torch.tensor(decode_tok, dtype=torch.int64), max_decode_len=max_decode,
        prefill_seq_ids=prefill_seq, block_size=block)
    decodes = torch.tensor(decode_seq, dtype=torch.int64)
    meta.decode_blocks = tables[decodes, :-(-max_decode // block)].flatten()
    if len(decode_seq) > 1:
        meta.decode_mask = (torch.arange(max_decode).unsqueeze(0) < lens[decodes].unsqueeze(1))[:, None, None]
    return meta, torch.tensor(positions)


class Driver:
    """The model with a paged KV cache and a state pool allocated here, run the way the engine will run it."""

    def __init__(self, model_dir, dtype: torch.dtype = torch.float32, chunk_size: int = CHUNK, **load) -> None:
        self.model = load_qwen35_model(model_dir, dtype, torch.device("cpu"), chunk_size=chunk_size, **load)
        cfg = self.model.cfg
        self.model.init_rope(cfg.max_position_embeddings, torch.device("cpu"))
        shape = (96, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                   for _ in range(self.model.num_kv_layers)]
        self.states = self.model.allocate_states(NUM_SLOTS, torch.device("cpu"))

    @torch.inference_mode()
    def run(self, seqs: list[StepInput], positions: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's logits [T, vocab]."""
        meta, flat_positions = attention_metadata(seqs)
        ids = torch.tensor([t for seq in seqs for t in seq.token_ids])
        hidden = self.model(ids, flat_positions if positions is None else positions, self.kv, meta,
                            states=self.states, state_batch=StateBatch.from_inputs(seqs))
        return self.model.compute_logits(hidden)

    def prefill(self, ids: list[int], cuts: list[int], table: list[int], slot: int) -> torch.Tensor:
        out, start = [], 0
        for end in cuts:
            out.append(self.run([StepInput(ids[start:end], start, table, state_slot=slot)]))
            start = end
        return torch.cat(out)


@pytest.fixture(scope="module", params=["causal-tied", "conditional-untied"])
def checkpoint(request, tmp_path_factory):
    conditional = request.param.startswith("conditional")
    path = make_qwen35_checkpoint(tmp_path_factory.mktemp(request.param), conditional=conditional,
                                  tied=not conditional)
    return path, load_hf_qwen35(path, conditional=conditional)


def hf_logits(hf, ids: list[int], **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), **kwargs).logits[0].float()


def test_whole_prompt_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    ids = prompt_ids(37)  # several delta-rule chunks, the last one partial
    ours = Driver(path).prefill(ids, [37], blocks_for(37), slot=2)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_continues_from_saved_states(checkpoint):
    """Cuts inside the conv window (5: the next chunk reads 3 saved inputs), inside delta-rule chunks (13, 22), and
    a one-token chunk (the recurrent step mid-prompt)."""
    path, hf = checkpoint
    ids = prompt_ids(37, seed=1)
    driver = Driver(path)
    driver.states[0][1][3].fill_(7.0)  # a stale state in the slot: the first chunk must start from zeros
    ours = driver.prefill(ids, [5, 6, 13, 22, 37], blocks_for(37, first=30), slot=3)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.fixture(params=["plain", "scaled"])
def decode_form(request, monkeypatch):
    """Both forms of a decode step's rule: plain (the decay applied to the state each step, as batches under
    delta_decode.SCALED_MIN_ROWS take it) and scaled (the decay kept in the state's scale, folds as it falls)."""
    if request.param == "scaled":
        monkeypatch.setattr(delta_decode, "SCALED_MIN_ROWS", 1)
    return request.param


def test_greedy_decode_equals_transformers_generate(checkpoint, decode_form):
    path, hf = checkpoint
    ids = prompt_ids(19, seed=2)
    driver = Driver(path)
    table = blocks_for(19 + 16)
    logits = driver.prefill(ids, [11, 19], table, slot=1)
    tokens = []
    for step in range(16):
        tokens.append(int(logits[-1].argmax()))
        logits = driver.run([StepInput([tokens[-1]], len(ids) + step, table, state_slot=1)])
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert tokens == ref


def test_a_chunk_after_scaled_decodes_equals_transformers(checkpoint, decode_form):
    """Decodes leave the states' scales below 1 (scaled form), then a 4-token chunk of the same sequence (the
    chunked rule, which reads true states: the scales are folded in first), then decodes again: transformers'
    logits throughout."""
    path, hf = checkpoint
    ids = prompt_ids(13, seed=12)
    driver = Driver(path)
    table = blocks_for(13 + 10)
    driver.prefill(ids, [13], table, slot=2)
    for token in (61, 62, 63):
        driver.run([StepInput([token], len(ids), table, state_slot=2)])
        ids = ids + [token]
    scales = torch.stack([scale[2] for _, _, scale in driver.states])
    assert bool((scales < 1).any()) == (decode_form == "scaled")
    chunk = [71, 72, 73, 74]
    ours = driver.run([StepInput(chunk, len(ids), table, state_slot=2)])
    torch.testing.assert_close(ours, hf_logits(hf, ids + chunk)[-4:], atol=1e-4, rtol=1e-4)
    ids = ids + chunk
    assert all(bool((scale[2] == 1).all()) for _, _, scale in driver.states)
    ours = driver.run([StepInput([81], len(ids), table, state_slot=2)])
    torch.testing.assert_close(ours, hf_logits(hf, ids + [81])[-1:], atol=1e-4, rtol=1e-4)


def test_prompts_of_different_lengths_and_decode_rows_in_one_forward(checkpoint):
    path, hf = checkpoint
    a, b, c, d = prompt_ids(14, seed=3), prompt_ids(23, seed=4), prompt_ids(30, seed=5), prompt_ids(1, seed=6)
    driver = Driver(path)
    ta, tb, tc, td = blocks_for(16), blocks_for(23, first=10), blocks_for(30, first=30), blocks_for(1, first=60)
    driver.prefill(a, [14], ta, slot=0)  # a decodes next; c's first 20 tokens are already in
    driver.prefill(c, [20], tc, slot=5)
    driver.states[1][1][4].fill_(3.0)  # b's slot holds a finished sequence's state
    driver.states[0][0][4].fill_(3.0)
    nxt = 77
    # c's last 10 tokens span 2 delta-rule chunks, b's 23 span 3: the scan's last round has b alone
    seqs = [StepInput(c[20:], 20, tc, state_slot=5), StepInput([nxt], 14, ta, state_slot=0),
            StepInput(b, 0, tb, state_slot=4), StepInput(d, 0, td, state_slot=2)]
    ours = driver.run(seqs)
    ref_c, ref_a = hf_logits(hf, c)[20:], hf_logits(hf, a + [nxt])[-1:]
    ref_b, ref_d = hf_logits(hf, b), hf_logits(hf, d)
    torch.testing.assert_close(ours, torch.cat([ref_c, ref_a, ref_b, ref_d]), atol=1e-4, rtol=1e-4)
    # and the states each row left behind carry on: one more decode for every sequence
    rows = [StepInput([5], 30, tc, state_slot=5), StepInput([6], 15, ta, state_slot=0),
            StepInput([7], 23, blocks_for(24, first=10), state_slot=4), StepInput([8], 1, blocks_for(2, first=60),
                                                                                  state_slot=2)]
    after = driver.run(rows)
    ref = torch.cat([hf_logits(hf, c + [5])[-1:], hf_logits(hf, a + [nxt, 6])[-1:], hf_logits(hf, b + [7])[-1:],
                     hf_logits(hf, d + [8])[-1:]])
    torch.testing.assert_close(after, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", [[0, 1, 2], [5, 3, 7], [1, 20, 40]], ids=["run", "span", "gathered"])
def test_decode_rows_follow_transformers_wherever_their_slots_lie(checkpoint, layout, decode_form):
    """Decode rows on a run of slots in batch order (updated in place), on permuted slots with gaps (the run
    between them updated in place: a gap's live state left exactly as it was, a free one's NaN kept to itself),
    and on slots far apart (gathered and scattered back): transformers' logits, two steps running."""
    path, hf = checkpoint
    prompts = [prompt_ids(9 + 4 * i, seed=10 + i) for i in range(3)]
    tables = [blocks_for(24, first=24 * i) for i in range(3)]
    driver = Driver(path)
    driver.states = driver.model.allocate_states(48, torch.device("cpu"))
    for ids, table, slot in zip(prompts, tables, layout):
        driver.prefill(ids, [len(ids)], table, slot)
    for conv, recurrent, _ in driver.states:  # slot 4: free and never written; slot 6: another sequence's state
        conv[4].fill_(float("nan"))
        recurrent[4].fill_(float("nan"))
        recurrent[6].fill_(2.5)
    nexts = [[31, 32], [41, 42], [51, 52]]
    for step in range(2):
        seqs = [StepInput([nxt[step]], len(ids) + step, table, state_slot=slot)
                for ids, nxt, table, slot in zip(prompts, nexts, tables, layout)]
        ours = driver.run(seqs)
        ref = torch.cat([hf_logits(hf, ids + nxt[:step + 1])[-1:] for ids, nxt in zip(prompts, nexts)])
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert all(bool((recurrent[6] == 2.5).all()) for _, recurrent, _ in driver.states)


def test_mrope_position_streams_match_transformers(checkpoint):
    """Three different position streams ([3, T], as images will give): each rotary frequency follows its stream."""
    path, hf = checkpoint
    ids = prompt_ids(12, seed=7)
    streams = torch.stack([torch.arange(12), torch.arange(12) // 3 + 2, torch.arange(12) % 4 + 5])
    driver = Driver(path)
    table = blocks_for(12)
    ours = driver.run([StepInput(ids, 0, table, state_slot=0)], positions=streams)
    assert not torch.allclose(ours, driver.run([StepInput(ids, 0, table, state_slot=1)]), atol=1e-3)
    ref = hf_logits(hf, ids, position_ids=streams.unsqueeze(1))  # [3, batch 1, T]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_chunk_size_does_not_change_the_result(checkpoint):
    path, _ = checkpoint
    ids = prompt_ids(40, seed=8)
    small = Driver(path, chunk_size=4).prefill(ids, [40], blocks_for(40), slot=0)
    large = Driver(path, chunk_size=64).prefill(ids, [40], blocks_for(40), slot=0)
    torch.testing.assert_close(small, large, atol=1e-5, rtol=1e-5)


def test_config_reads_both_forms_and_layer_kinds(checkpoint):
    path, _ = checkpoint
    cfg = read_model_config(path)
    assert cfg.family == "qwen3_5" and cfg.rotary_dim == 8 and cfg.hybrid.mrope_section == (2, 1, 1)
    assert cfg.hybrid.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 \
        + ("full_attention",)
    assert (cfg.hybrid.linear_num_key_heads, cfg.hybrid.linear_num_value_heads) == (2, 4)
    conditional = cfg.architecture == "Qwen3_5ForConditionalGeneration"
    assert cfg.hybrid.tensor_prefix == ("model.language_model." if conditional else "model.")
    assert cfg.tie_word_embeddings is not conditional
    model = load_qwen35_model(path, torch.float32, torch.device("cpu"))
    assert model.num_kv_layers == 2 and len(model.allocate_states(3, torch.device("cpu"))) == 6


def test_an_unknown_tensor_is_still_an_error_while_vision_and_mtp_are_set_aside(tmp_path, caplog):
    from safetensors.torch import save_file

    path = make_qwen35_checkpoint(tmp_path / "ckpt", conditional=True)  # carries model.visual.* and mtp.*
    with caplog.at_level(logging.INFO, logger="rawserve.engine"):
        load_qwen35_model(path, torch.float32, torch.device("cpu"))
    # the log names what each set-aside part is (a vision checkpoint serving images must not read as "dropped")
    [line] = [r.getMessage() for r in caplog.records if "left to other parts" in r.getMessage()]
    assert "model.visual.* (the vision tower" in line and "mtp.* (the MTP head" in line, line
    assert "model.language_model." not in line
    caplog.clear()  # the tower's own load sets aside the text stack, and says nothing of it
    with caplog.at_level(logging.INFO, logger="rawserve.engine"):
        load_vision_tower(path, read_model_config(path), torch.float32, torch.device("cpu"))
    assert not [r for r in caplog.records if "left to other parts" in r.getMessage()]
    save_file({"model.language_model.extra.weight": torch.zeros(2)}, str(path / "model-extra.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.language_model.extra.weight"] = "model-extra.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.language_model.extra.weight'"):
        load_qwen35_model(path, torch.float32, torch.device("cpu"))


def test_bad_layer_types_are_named(tmp_path):
    path = make_qwen35_checkpoint(tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["linear_attention"] * 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layer_types"):
        read_model_config(path)


def test_sharded_bf16_checkpoint_served_in_float32_matches_transformers(tmp_path):
    path = make_qwen35_checkpoint(tmp_path / "ckpt", conditional=True, dtype="bfloat16", max_shard_size="40KB")
    assert len(list(path.glob("model-0*.safetensors"))) > 1
    ids = prompt_ids(21, seed=9)
    ours = Driver(path).prefill(ids, [21], blocks_for(21), slot=0)
    ref = hf_logits(load_hf_qwen35(path, conditional=True, dtype="float32"), ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_model_follows_float32(tmp_path):
    path = make_qwen35_checkpoint(tmp_path / "ckpt")
    ids = prompt_ids(24, seed=10)
    f32 = Driver(path).prefill(ids, [10, 24], blocks_for(24), slot=0)
    bf16 = Driver(path, dtype=torch.bfloat16).prefill(ids, [10, 24], blocks_for(24), slot=0)
    assert Driver(path, dtype=torch.bfloat16).states[0][1].dtype == torch.float32  # the recurrence stays float32
    torch.testing.assert_close(bf16, f32, atol=6e-2, rtol=6e-2)
    assert (bf16.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("scheme, names, max_error", [
    ("int8", {"in_proj", "out_proj", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, 0.25),
    # int4's kernel takes no in_proj of 160 + 96 + 8 rows (out % 16): it stays dense, as the quantizer logs
    ("int4", {"out_proj", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, 0.5)])
def test_quantized_linears_load_and_follow_the_dense_model(tmp_path, scheme, names, max_error):
    """Both layer kinds' matrices quantize as they load; a random 8-layer model drifts (measured: 0.14 relative
    for int8, 0.29 for int4) but stays the same model (wrong slices or a missed layer give ~1.4)."""
    path = make_qwen35_checkpoint(tmp_path / "ckpt", tied=False)
    ids = prompt_ids(20, seed=11)
    dense = Driver(path).prefill(ids, [20], blocks_for(20), slot=0)
    quant = Driver(path, quant=probe_plan(scheme, 32, torch.device("cpu")))
    assert {name for layer in quant.model.layers for name in layer.quant} == names
    assert quant.model.quant_head is not None
    ours = quant.prefill(ids, [20], blocks_for(20), slot=0)
    assert (ours - dense).norm() / dense.norm() < max_error
