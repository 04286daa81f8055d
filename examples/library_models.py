"""Tiny random-init models of diffusers and sentence-transformers (nothing is downloaded).

Each builder seeds torch first, so a fresh process builds the same weights
(``tests/test_libraries.py`` loads artifacts with ``model=`` such a rebuild).
"""

from __future__ import annotations

import os
from typing import Any

import torch

WORDS = "the a cat dog sat on mat ran fast slow red blue green big small house tree car road sun"


def diffusers_model(name: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """``unet`` (UNet2DModel), ``unet_cond`` (UNet2DConditionModel) or ``vae_decoder``
    (an AutoencoderKL's decoder), and example positional arguments."""
    import diffusers

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    small = dict(layers_per_block=1, block_out_channels=(8, 16), norm_num_groups=4)
    if name == "unet":
        model = diffusers.UNet2DModel(
            sample_size=8,
            in_channels=3,
            out_channels=3,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=4,
            **small,
        )
        args: tuple[Any, ...] = (torch.randn(2, 3, 8, 8, generator=gen), torch.tensor([10, 20]))
    elif name == "unet_cond":
        model = diffusers.UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16,
            attention_head_dim=4,
            **small,
        )
        args = (
            torch.randn(2, 4, 8, 8, generator=gen),
            torch.tensor([10, 20]),
            torch.randn(2, 5, 16, generator=gen),
        )
    elif name == "vae_decoder":
        vae = diffusers.AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 16),
            latent_channels=4,
            norm_num_groups=4,
            sample_size=16,
        )
        model = vae.decoder
        args = (torch.randn(2, 4, 8, 8, generator=gen),)
    else:
        raise ValueError(name)
    return model.eval(), args


def sentence_transformer(directory: str) -> torch.nn.Module:
    """A SentenceTransformer (a 2-layer BERT, mean pooling) saved to and read from
    ``directory``: its tokenizer has a vocabulary of a few words."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS.split()]
    os.makedirs(directory, exist_ok=True)
    vocab_file = os.path.join(directory, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(vocab) + "\n")
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    BertModel(config).eval().save_pretrained(directory)
    BertTokenizerFast(vocab_file=vocab_file).save_pretrained(directory)
    transformer = Transformer(directory, max_seq_length=64)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu").eval()


# Batches of varying size and padded length (unknown words tokenize to [UNK]).
SENTENCE_BATCHES = [
    ["the cat sat on the mat", "a dog ran", "red car"],
    ["sun"],
    ["the big red house on the road ran fast slow", "tree"] * 3,
    ["a b c d e f g h i j k l m n o p q r s t u v w x y z the cat"] * 5,
]
