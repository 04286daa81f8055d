"""Tiny random-init configs of real library models, and how outputs are compared.

Shared by ``benchmarks/survey_transformers.py`` (every config here) and the
test suite (``tests/test_real_transformers.py`` takes the entries whose fixes
it guards; ``tests/conftest.py`` compares outputs with :func:`assert_same_output`).
Nothing is downloaded: each builder makes a model from a config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

VOCAB = 1000

# name -> (build the model, positional args, keyword args)
Catalogue = dict[str, tuple[Callable[[], torch.nn.Module], tuple, dict]]


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _images(size: int = 32) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))


def survey_models() -> Catalogue:
    import transformers as T

    small = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
    )
    decoder = dict(small, num_key_value_heads=2, max_position_embeddings=64)
    vit = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    seq2seq = dict(
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        vocab_size=VOCAB,
    )
    text = (_ids(2, 16),)
    return {
        "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**decoder)), text, {}),
        "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**decoder)), text, {}),
        "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**decoder, head_dim=16)), text, {}),
        "gemma": (lambda: T.GemmaForCausalLM(T.GemmaConfig(**decoder, head_dim=16)), text, {}),
        "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**decoder, head_dim=16)), text, {}),
        "phi3": (
            lambda: T.Phi3ForCausalLM(
                T.Phi3Config(**decoder, pad_token_id=0, bos_token_id=1, eos_token_id=2)
            ),
            text,
            {},
        ),
        "gpt_neox": (
            lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**small, max_position_embeddings=64)),
            text,
            {},
        ),
        "opt": (
            lambda: T.OPTForCausalLM(
                T.OPTConfig(
                    hidden_size=64,
                    num_hidden_layers=2,
                    ffn_dim=128,
                    num_attention_heads=4,
                    vocab_size=VOCAB,
                    max_position_embeddings=64,
                    word_embed_proj_dim=64,
                )
            ),
            text,
            {},
        ),
        "falcon": (
            lambda: T.FalconForCausalLM(
                T.FalconConfig(
                    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB
                )
            ),
            text,
            {},
        ),
        "bart": (
            lambda: T.BartForConditionalGeneration(
                T.BartConfig(**seq2seq, max_position_embeddings=64)
            ),
            text,
            {"decoder_input_ids": _ids(2, 8, seed=1)},
        ),
        "whisper": (
            lambda: T.WhisperModel(
                T.WhisperConfig(
                    **seq2seq,
                    num_mel_bins=16,
                    max_source_positions=8,
                    max_target_positions=32,
                    pad_token_id=0,
                    bos_token_id=1,
                    eos_token_id=2,
                    decoder_start_token_id=1,
                )
            ),
            (torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0)),),
            {"decoder_input_ids": _ids(2, 8, seed=1)},
        ),
        "clip": (
            lambda: T.CLIPModel(
                T.CLIPConfig(
                    text_config=dict(
                        small, max_position_embeddings=16, bos_token_id=1, eos_token_id=2
                    ),
                    vision_config=dict(vit),
                    projection_dim=32,
                )
            ),
            (),
            {"input_ids": _ids(2, 16), "pixel_values": _images()},
        ),
        "roberta": (
            lambda: T.RobertaModel(T.RobertaConfig(**small, max_position_embeddings=64)),
            text,
            {},
        ),
        "albert": (lambda: T.AlbertModel(T.AlbertConfig(**small, embedding_size=32)), text, {}),
        "swin": (
            lambda: T.SwinModel(
                T.SwinConfig(
                    image_size=32,
                    patch_size=4,
                    embed_dim=16,
                    depths=[1, 1],
                    num_heads=[2, 2],
                    window_size=4,
                )
            ),
            (_images(),),
            {},
        ),
        "deit": (lambda: T.DeiTModel(T.DeiTConfig(**vit)), (_images(),), {}),
        "segformer": (
            lambda: T.SegformerModel(
                T.SegformerConfig(
                    num_encoder_blocks=2,
                    depths=[1, 1],
                    sr_ratios=[2, 1],
                    hidden_sizes=[16, 32],
                    patch_sizes=[7, 3],
                    strides=[4, 2],
                    num_attention_heads=[1, 2],
                    mlp_ratios=[2, 2],
                )
            ),
            (_images(),),
            {},
        ),
        "wav2vec2": (
            lambda: T.Wav2Vec2Model(
                T.Wav2Vec2Config(
                    hidden_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    intermediate_size=128,
                    conv_dim=(16, 16),
                    conv_stride=(5, 2),
                    conv_kernel=(10, 3),
                    num_conv_pos_embeddings=16,
                    num_conv_pos_embedding_groups=4,
                )
            ),
            (),
            {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(0))},
        ),
    }


def extra_models() -> Catalogue:
    """Variants and more architectures (``--extra``): sliding windows, ALiBi, padding
    masks, mixture of experts, state-space models, more encoders."""
    import transformers as T

    small = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
    )
    decoder = dict(small, num_key_value_heads=2, max_position_embeddings=64)
    text = (_ids(2, 16),)
    left_padded = torch.ones(2, 16, dtype=torch.long)
    left_padded[1, :5] = 0
    audio = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
    )
    return {
        "llama_left_padded": (
            lambda: T.LlamaForCausalLM(T.LlamaConfig(**decoder)),
            text,
            {"attention_mask": left_padded},
        ),
        "mistral_sliding": (
            lambda: T.MistralForCausalLM(T.MistralConfig(**decoder, sliding_window=4)),
            text,
            {},
        ),
        "gemma2_sliding": (
            lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**decoder, head_dim=16, sliding_window=4)),
            text,
            {},
        ),
        "gemma3_text": (
            lambda: T.Gemma3ForCausalLM(
                T.Gemma3TextConfig(**decoder, head_dim=16, sliding_window=4)
            ),
            text,
            {},
        ),
        "mixtral": (
            lambda: T.MixtralForCausalLM(
                T.MixtralConfig(**decoder, num_local_experts=4, num_experts_per_tok=2)
            ),
            text,
            {},
        ),
        "falcon_alibi": (
            lambda: T.FalconForCausalLM(
                T.FalconConfig(
                    hidden_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    vocab_size=VOCAB,
                    alibi=True,
                    new_decoder_architecture=False,
                )
            ),
            text,
            {"attention_mask": left_padded},
        ),
        "bloom": (
            lambda: T.BloomForCausalLM(
                T.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)
            ),
            text,
            {},
        ),
        "gptj": (
            lambda: T.GPTJForCausalLM(
                T.GPTJConfig(
                    n_embd=64,
                    n_layer=2,
                    n_head=4,
                    rotary_dim=8,
                    vocab_size=VOCAB,
                    bos_token_id=1,
                    eos_token_id=2,
                )
            ),
            text,
            {},
        ),
        "mamba": (
            lambda: T.MambaForCausalLM(
                T.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, state_size=8)
            ),
            text,
            {},
        ),
        "deberta_v2": (
            lambda: T.DebertaV2Model(
                T.DebertaV2Config(
                    **small,
                    max_position_embeddings=64,
                    relative_attention=True,
                    pos_att_type=["p2c", "c2p"],
                )
            ),
            text,
            {},
        ),
        "electra": (
            lambda: T.ElectraModel(
                T.ElectraConfig(**small, embedding_size=32, max_position_embeddings=64)
            ),
            text,
            {},
        ),
        "modernbert": (
            lambda: T.ModernBertModel(
                T.ModernBertConfig(
                    **small,
                    max_position_embeddings=64,
                    local_attention=8,
                    pad_token_id=0,
                    bos_token_id=1,
                    eos_token_id=2,
                    cls_token_id=1,
                    sep_token_id=2,
                )
            ),
            text,
            {},
        ),
        "dinov2": (
            lambda: T.Dinov2Model(
                T.Dinov2Config(
                    hidden_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    image_size=32,
                    patch_size=8,
                )
            ),
            (_images(),),
            {},
        ),
        "hubert": (
            lambda: T.HubertModel(T.HubertConfig(**audio)),
            (),
            {"input_values": torch.randn(2, 400, generator=torch.Generator().manual_seed(0))},
        ),
    }


def output_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in an output: tuples, lists, mappings and plain objects (caches)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 8:
        return []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = list(vars(value).values())
    else:
        return []
    return [t for item in items for t in output_tensors(item, depth + 1)]


def assert_same_output(got: Any, want: Any, rtol: float = 1e-4, atol: float = 1e-4) -> float:
    """``got`` has ``want``'s type and tensors (compared with tolerances); returns the
    largest absolute difference. Raises AssertionError otherwise."""
    if type(got) is not type(want):
        raise AssertionError(f"output type {type(got).__name__}, eager {type(want).__name__}")
    got_t, want_t = output_tensors(got), output_tensors(want)
    if len(got_t) != len(want_t) or not want_t:
        raise AssertionError(f"{len(got_t)} output tensors, eager {len(want_t)}")
    for g, w in zip(got_t, want_t):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    return max((g.float() - w.float()).abs().max().item() for g, w in zip(got_t, want_t))
