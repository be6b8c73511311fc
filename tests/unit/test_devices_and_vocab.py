"""What a GPU run needs that a CPU test can check: tensors reach numpy through the host, generators live
where the probabilities do, KV buffers sit beside their layer, and pairs with padded vocabularies of
different widths sample losslessly (prompt lookup and a draft model)."""

import ast
import asyncio
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.decoding.draft_length import DraftLengthPolicy
from specdec.decoding.loop import GenerationRequest, generate
from specdec.decoding.ngram_proposer import NgramProposer
from specdec.decoding.sampling import SamplingParams, make_generator
from specdec.decoding.text import same_tokenizer_files, vocabulary_mismatch
from specdec.engine.build import dynamic_executor
from specdec.engine.kv_cache import layer_devices
from specdec.engine.local import LocalProposer, LocalScorer, collect

SRC = Path(__file__).resolve().parents[2] / "src" / "specdec"
TOKENS = 90  # ids a tokenizer would produce; the models' vocabularies are padded past it


def tiny(vocab: int, layers: int, seed: int):
    """A tiny llama whose vocabulary is padded to `vocab` past the TOKENS real ids: like a trained model,
    it gives the padding ids no mass (a trained model learns that; a random one is told)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    model.lm_head.register_forward_hook(lambda module, args, logits: logits.index_fill(
        -1, torch.arange(TOKENS, vocab, device=logits.device), float("-inf")))
    return model


def test_every_tensor_reaches_numpy_through_the_host():
    """`.numpy()` on a CUDA tensor raises: in the model-running layers every call must follow `.cpu()`."""
    offenders = []
    for path in list((SRC / "engine").glob("*.py")) + list((SRC / "triton").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy":
                receiver = node.func.value
                if not (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute)
                        and receiver.func.attr == "cpu"):
                    offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders


def test_generators_are_made_on_the_requested_device():
    assert make_generator(1, "cpu").device.type == "cpu"
    assert make_generator(1, torch.device("cpu")).initial_seed() == 1
    if torch.cuda.is_available():
        assert make_generator(1, "cuda:0").device.type == "cuda"


def test_each_layers_kv_buffers_live_on_that_layers_device():
    """A spread model (device_map=auto) has layers on several devices; 'meta' stands in for a second GPU."""
    model = tiny(TOKENS, 3, 0)
    model.model.layers[1].to("meta")
    lm = dynamic_executor(model)
    assert [d.type for d in layer_devices(model, 3)] == ["cpu", "meta", "cpu"]
    seq = lm.kv.new_sequence()
    assert [k.device.type for k in seq.keys] == ["cpu", "meta", "cpu"]
    assert [v.device.type for v in seq.values] == ["cpu", "meta", "cpu"]
    seq.reserve(seq.capacity + 1)  # growth keeps each buffer where it was
    assert [k.device.type for k in seq.keys] == ["cpu", "meta", "cpu"]


@pytest.mark.parametrize("draft", ["ngram", "draft_model"])
def test_padded_vocabularies_of_different_widths_sample_without_error(draft):
    """Target logits 160 wide, draft 128 wide, tokenizer 90 ids: the rows are compared as one width."""
    target = dynamic_executor(tiny(160, 2, 0))
    proposer = NgramProposer(min_ngram=1) if draft == "ngram" else LocalProposer(dynamic_executor(tiny(128, 1, 1)))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]  # repeats, so prompt lookup proposes
    for seed in range(3):
        req = GenerationRequest(seq_id=1, prompt_ids=prompt, max_tokens=12,
                                sampling=SamplingParams(temperature=1.0, top_k=50, seed=seed))
        out = asyncio.run(collect(generate(req, proposer, LocalScorer(target), DraftLengthPolicy.fixed(3))))
        assert len(out) == 12 and all(0 <= t < TOKENS for t in out)


def test_a_draft_token_beyond_the_targets_vocabulary_is_rejected_and_resampled():
    """A draft wider than the target may propose an id the target cannot produce: p_target = 0, so it is
    always rejected, and the correction comes from the target's own distribution."""
    from specdec.decoding.interfaces import Proposal, Scores
    from specdec.decoding.loop import _verify

    draft_probs = torch.zeros(1, 8)
    draft_probs[0, 7] = 1.0  # id 7 exists only in the draft's padded vocabulary
    target_logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 0.0, 0.0], [0.0] * 6])
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        verdict = _verify(Proposal([7], draft_probs, 1), Scores(target_logits.argmax(-1), target_logits), target_logits,
                          params, g)
        assert verdict.path == () and 0 <= verdict.next_token < 6


def test_seeded_sampling_with_a_draft_model_is_reproducible():
    target, draft = dynamic_executor(tiny(160, 2, 0)), dynamic_executor(tiny(128, 1, 1))
    req = GenerationRequest(seq_id=3, prompt_ids=[1, 2, 3], max_tokens=16,
                            sampling=SamplingParams(temperature=0.8, seed=42))

    def run():
        return asyncio.run(collect(generate(req, LocalProposer(draft), LocalScorer(target),
                                            DraftLengthPolicy.fixed(4))))

    assert run() == run()


def test_a_draft_with_another_vocabulary_is_named():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    same = {"a": 0, "b": 1, "c": 2}
    assert vocabulary_mismatch(Tok(same), Tok(same)) is None
    problem = vocabulary_mismatch(Tok({"a": 0, "c": 1, "b": 2}), Tok(same))
    assert "2 mapped differently" in problem and "'b'" in problem


def test_identical_tokenizer_files_need_no_loading_anything_else_does(tmp_path):
    """same_tokenizer_files: byte-equal tokenizer files in both directories (the draft's vocabulary check then
    loads neither tokenizer); a changed byte, a file on one side only, or no tokenizer at all: not the same."""
    from specdec.serving.pairs import smollm2_tokenizer_dir

    source = smollm2_tokenizer_dir()
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (d / name).write_bytes((source / name).read_bytes())
        (d / "config.json").write_text(f'{{"from": "{d.name}"}}')  # not a tokenizer file: may differ
    assert same_tokenizer_files(a, b) and same_tokenizer_files(str(a), str(b))
    raw = bytearray((b / "tokenizer.json").read_bytes())
    raw[len(raw) // 2] ^= 1
    (b / "tokenizer.json").write_bytes(bytes(raw))
    assert not same_tokenizer_files(a, b)
    (b / "tokenizer.json").write_bytes((a / "tokenizer.json").read_bytes())
    (b / "special_tokens_map.json").write_text("{}")
    assert not same_tokenizer_files(a, b) and not same_tokenizer_files(b, a)
    assert not same_tokenizer_files(tmp_path / "none", a) and not same_tokenizer_files(a / "tokenizer.json", a)
