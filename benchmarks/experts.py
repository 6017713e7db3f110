"""A LoRA training step on a mixture-of-experts model vs transformers + peft.

No MoE model ships in a package, so this builds a random-init Qwen3-MoE (8 layers, hidden
512, 16 experts of which 2 a token, each of intermediate size 384, the bundled model's
tokenizer and vocabulary) in a temporary folder; ``--experts 128 --per-token 8
--expert-size 64`` routes as Qwen3-30B-A3B does (the same FLOPs a token). Rank 16 on the attention projections and on every expert's
``gate_up_proj``/``down_proj`` (TRIO: ``lora.LoRAExperts``; peft: ``target_parameters``),
AdamW, 8 x 128 tokens; fp32. Both start from B = 0, so their first losses are the base
model's and must agree (printed).

peft folds each expert's low-rank change into the weights for the forward (one
``baddbmm`` over all experts per tensor); TRIO runs each product of the adapter's tokens
as one grouped matmul over the experts (``lora.grouped_linear``).

    RESULT experts_train_step_<E>x<k> ours=<tokens/s> baseline=<tokens/s> ratio=...

Run: .venv/bin/python benchmarks/experts.py [--repeats 5] [--experts E --per-token k --expert-size I]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from common import result, timed_pair

from trio_engine import DEFAULT_MODEL, AdamConfig, Example, ForwardJob, LoraConfig, ModelHost
from trio_engine.catalog import Catalog, load_tokenizer

NAME = "bench/tiny-moe"
ROWS, LENGTH, RANK = 8, 128, 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def moe_folder(folder: Path, experts: int, per_token: int, expert_size: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = load_tokenizer(Catalog().resolve(DEFAULT_MODEL))
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(tokenizer), hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, moe_intermediate_size=expert_size, num_experts=experts, num_experts_per_tok=per_token,
        max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def ours_step(host: ModelHost, seqs: list[list[int]]):
    data = [Example(s[:-1], {"target_tokens": s[1:]}) for s in seqs]
    losses = []

    def step() -> None:
        out = host.forward_backward([ForwardJob("bench", data)])[0]
        losses.append(out.metrics["loss:sum"] / (len(seqs) * LENGTH))
        host.optim_step("bench", AdamConfig(learning_rate=1e-4))

    return step, losses


def peft_step(folder: Path, seqs: list[list[int]]):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(model, PeftLoraConfig(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=ATTENTION,
                                                 target_parameters=EXPERTS))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.tensor([s[:-1] for s in seqs])
    labels = torch.tensor([s[1:] for s in seqs])
    losses = []

    def step() -> None:
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--per-token", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=384)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = moe_folder(Path(tmp) / "moe", args.experts, args.per_token, args.expert_size)
        catalog = Catalog()
        catalog.add_folder(NAME, folder)
        host = ModelHost(NAME, dtype="float32", catalog=catalog)
        host.create_adapter("bench", LoraConfig(rank=RANK, train_unembed=False))
        rng = random.Random(0)
        seqs = [[rng.randrange(host.vocab_size) for _ in range(LENGTH + 1)] for _ in range(ROWS)]
        ours, our_losses = ours_step(host, seqs)
        baseline, their_losses = peft_step(folder, seqs)
        timings = timed_pair(ours, baseline, args.repeats)
        print(f"first losses (B = 0, the base model's): ours {our_losses[0]:.6f}, peft {their_losses[0]:.6f}")
        tokens = ROWS * LENGTH
        result(f"experts_train_step_{args.experts}x{args.per_token}", tokens / timings["ours"],
               tokens / timings["baseline"], " (tokens/s, fp32, rank 16, 8 x 128)", timings.spread())


if __name__ == "__main__":
    main()
