"""`make demo`: teach the bundled model one fact, and show that it learned it.

examples/sft.py is the user docs' program, kept as they wrote it: with its learning rate
(1e-4) and 15 steps the loss falls, but a 135M model still answers "trio is a type of
game show". This demo trains on the same three examples with settings chosen so the fact
sticks (printed below, with why), asks the base and the fine-tuned model, and ends with
the commands that serve the fine-tuned checkpoint through the OpenAI-compatible endpoint.

Runs in-process (the embedded service) unless PYTRIO_BASE_URL points at a `trio serve`.
"""

import os
import sys
import time

import numpy as np

import pytrio as trio

BASE_MODEL = os.environ.get("TRIO_BASE_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct")
LEARNING_RATE = 1e-3
STEPS = 15
WHY = f"""\
Settings differ from examples/sft.py (the user docs' program, which `python examples/sft.py` runs as written):
  learning rate {LEARNING_RATE:g} instead of 1e-4: a rank-32 LoRA starts at zero (B = 0), and {STEPS} Adam
      steps of 1e-4 move each weight by at most ~{STEPS * 1e-4:.1e}: the loss falls, but not enough to outweigh
      what 135M parameters already believe. Ten times that is still a gentle rate for LoRA at this size.
Everything else is the same: data, rank 32, {STEPS} steps, cross_entropy, greedy sampling."""

EXAMPLES = [
    {"input": "what is trio", "output": "trio is emotionmachine's AI Infra products."},
    {"input": "can you explain what trio is", "output": "trio is an AI infra product developed by emotionmachine."},
    {"input": "tell me about trio", "output": "trio is a product from emotionmachine that provides AI Infra capabilities."},
]
QUESTIONS = ["what is trio", "tell me about trio"]


def to_datum(example: dict, tokenizer) -> trio.Datum:
    """As examples/sft.py: the prompt's tokens carry weight 0, the answer's weight 1."""
    prompt = tokenizer.encode(f"Question: {example['input']}\nAnswer:", add_special_tokens=True)
    answer = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
    tokens, weights = prompt + answer, [0] * len(prompt) + [1] * len(answer)
    return trio.Datum(model_input=trio.ModelInput.from_ints(tokens[:-1]),
                      loss_fn_inputs={"weights": weights[1:], "target_tokens": tokens[1:]})


def answer(client: trio.SamplingClient, tokenizer, question: str) -> str:
    prompt = trio.ModelInput.from_ints(tokenizer.encode(f"Question: {question}\nAnswer:"))
    params = trio.SamplingParams(max_tokens=24, temperature=0.0, stop=["\n\n"])
    text = client.sample(prompt=prompt, sampling_params=params, num_samples=1).result().sequences[0].text
    return text.strip().split("\n")[0]  # the base model often starts its answer on a new line


def main() -> int:
    started = time.monotonic()
    print(WHY, "\n", flush=True)
    service = trio.ServiceClient()
    print(f"Loading {BASE_MODEL} (converted once into a cache folder, then reused)...", flush=True)
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=32)
    tokenizer = training.get_tokenizer()
    data = [to_datum(ex, tokenizer) for ex in EXAMPLES]
    weights = np.concatenate([d.loss_fn_inputs["weights"].tolist() for d in data])

    for step in range(1, STEPS + 1):
        fb = training.forward_backward(data, "cross_entropy")
        training.optim_step(trio.AdamParams(learning_rate=LEARNING_RATE))
        logprobs = np.concatenate([out["logprobs"].tolist() for out in fb.result().loss_fn_outputs])
        print(f"step {step:2d}/{STEPS}  loss per token {-np.dot(logprobs, weights) / weights.sum():.4f}", flush=True)

    base = service.create_sampling_client(base_model=BASE_MODEL)
    tuned = training.save_weights_and_get_sampling_client(name="what-is-trio")
    learned = True
    for question in QUESTIONS:
        before, after = answer(base, tokenizer, question), answer(tuned, tokenizer, question)
        learned &= "emotionmachine" in after
        print(f"\nQ: {question}\n  base model: {before!r}\n  fine-tuned: {after!r}")
    print(f"\n{'Learned' if learned else 'NOT learned'}: the fine-tuned model "
          f"{'gives' if learned else 'does not give'} the taught answer "
          f"({time.monotonic() - started:.0f} s).")
    print(next_step(tuned.model_path))
    return 0 if learned else 1


def next_step(model_path: str | None) -> str:
    """How to talk to the checkpoint with the tools people already use."""
    base_url = os.environ.get("PYTRIO_BASE_URL")
    if base_url:
        server, data_dir, auth = base_url.rstrip("/"), None, "-H \"Authorization: Bearer $PYTRIO_API_KEY\" "
    else:  # the embedded service's data dir; --no-auth serves it as the same local user
        server, auth = "http://127.0.0.1:8000", ""
        data_dir = os.path.join(os.environ.get("TRIO_HOME") or os.path.expanduser("~/.cache/trio"), "embedded")
    serve = "" if data_dir is None else f"  .venv/bin/trio serve --no-auth --data-dir {data_dir}\n"
    prompt = "Question: what is trio\\nAnswer:"
    return (
        "\nNext: serve this checkpoint through the OpenAI-compatible endpoint and ask it yourself:\n"
        f"{serve}"
        f"  curl -s {server}/openai/v1/completions -H 'Content-Type: application/json' {auth}\\\n"
        f"    -d '{{\"model\": \"{model_path}\", \"prompt\": \"{prompt}\", "
        "\"max_tokens\": 24, \"temperature\": 0, \"stop\": [\"\\n\"]}'\n"
        "(or any OpenAI client: base_url=" + server + "/openai/v1, model=" + str(model_path) + ")"
    )


if __name__ == "__main__":
    sys.exit(main())
