"""The user's ``trio`` commands (runs, checkpoints, export) end to end.

Against a real server (uvicorn on port 0, API keys: alice trains, bob is someone else)
and against the embedded service (``TRIO_HOME`` in a tmp dir). The commands run
in-process through ``trio_cli.main``, except one run of the real entry point
(``python -m trio_cli``) in a subprocess.

Export is checked against TRIO itself: the merged folder, loaded by plain transformers,
greedy-decodes what TRIO's sampler decodes at temperature 0 and gives TRIO's logprobs;
the PEFT folder, loaded by peft, gives the merged model's logits. On the tiny Llama
(untied embeddings) and a tiny Llama with tied embeddings (as SmolLM2's), each with the
unembedding trained and not, and a tiny Qwen3-MoE, its experts trained with the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import load_file

import pytrio as trio
from trio_cli import main

from .engine.helpers import plain_model, tiny_moe_folder, tiny_tied_folder
from .sdk.conftest import ServerThread

TINY = "trio/tiny-llama"
TIED = "test/tiny-tied"
MOE = "test/tiny-moe"  # a Qwen3-MoE: its experts train too (lora.LoRAExperts)
CASES = [(TINY, True), (TINY, False), (TIED, True), (TIED, False), (MOE, True)]  # (base model, train_unembed)
IDS = ["tiny-unembed", "tiny-no-unembed", "tied-unembed", "tied-no-unembed", "moe-unembed"]
PROMPTS = ["The capital of France is", "Merging adapters into weights", "Once upon a time"]
COMPLETIONS = [" a tiny model that learned", " keeps the same greedy answer", " there was a checkpoint"]


def trio_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``trio <argv>`` in this process: (exit status, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    return [(tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(c, add_special_tokens=False))
            for p, c in zip(PROMPTS, COMPLETIONS)]


def train(service, base_model: str, train_unembed: bool, name: str, steps: int = 6):
    """A run trained towards each prompt's completion with a large learning rate (so B is
    far from zero and greedy decoding has clear winners); returns (run id, sampler path,
    state path, examples)."""
    tc = service.create_lora_training_client(base_model=base_model, rank=8, seed=3, train_unembed=train_unembed)
    data = examples(tc.get_tokenizer())
    batch = [trio.Datum(model_input=trio.ModelInput.from_ints((p + c)[:-1]),
                        loss_fn_inputs={"target_tokens": (p + c)[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(c)})
             for p, c in data]
    for _ in range(steps):
        tc.forward_backward(batch, "cross_entropy")
        tc.optim_step(trio.AdamParams(learning_rate=0.05))
    sampler = tc.save_weights_for_sampler(name).result().path
    state = tc.save_state(name).result().path
    return tc.model_id, sampler, state, data


def greedy_trio(sampler, prompt: list[int], n: int) -> list[int]:
    params = trio.SamplingParams(max_tokens=n, temperature=0.0)
    return sampler.sample(trio.ModelInput.from_ints(prompt), 1, params).result().sequences[0].tokens


def greedy_hf(model, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """Plain transformers greedy decoding; up to and including the first EOS, as TRIO's."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def greedy_gaps(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """At each step of a greedy decode, the top logit minus the runner-up."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]  # (n, V)
    top2 = logits.float().topk(2).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def logprobs_hf(model, tokens: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t) under a plain transformers model, in float64 from its logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].double()  # (T, V)
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


# --------------------------------------------------------------------------- a server


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A server with API keys on a catalog that has a tied tiny Llama; alice's runs."""
    from trio_server.app import create_app
    from trio_server.core import ServiceCore

    root = tmp_path_factory.mktemp("cli-user")
    tied = tiny_tied_folder(root / "tied", generation={"max_length": 321, "eos_token_id": 2})
    moe = tiny_moe_folder(root / "moe")
    patch = pytest.MonkeyPatch()
    patch.setenv("TRIO_MODELS", f"{TIED}={tied},{MOE}={moe}")  # the server's catalog, and export's, see them
    for name in ("PYTRIO_BASE_URL", "PYTRIO_API_KEY"):
        patch.delenv(name, raising=False)
    core = ServiceCore(root / "server", dtype="float32")
    server = ServerThread(create_app(core, auth=True))
    alice, bob = core.store.create_api_key("alice"), core.store.create_api_key("bob")
    service = trio.ServiceClient(base_url=server.url, api_key=alice)
    runs = {case: train(service, *case, name=f"ckpt-{i}") for i, case in enumerate(CASES)}

    yield SimpleNamespace(
        tied_folder=tied, moe_folder=moe, core=core, server=server, service=service, runs=runs, alice_key=alice,
        alice=["--base-url", server.url, "--api-key", alice], bob=["--base-url", server.url, "--api-key", bob])
    server.stop()
    core.close()
    patch.undo()


def test_runs_list(world, capsys):
    code, out, _ = trio_cli(capsys, "runs", "list", *world.alice)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "BASE", "MODEL", "RANK", "STEP", "CREATED", "(UTC)"]
    for run_id, *_ in world.runs.values():
        row = next(line for line in lines if line.startswith(run_id))
        fields = row.split()
        assert fields[1] in (TINY, TIED, MOE) and fields[2:4] == ["8", "6"], row  # rank 8, 6 steps
        assert len(fields[4]) == 10 and len(fields[5]) == 8  # YYYY-MM-DD HH:MM:SS
    # bob sees none of alice's runs
    code, out, _ = trio_cli(capsys, "runs", "list", *world.bob)
    assert code == 0 and not any(run_id in out for run_id, *_ in world.runs.values())


def test_usage(world, capsys):
    """``trio usage``: alice's runs, each with its trained tokens (6 steps of 3 examples);
    bob, who trained nothing, sees only a zero total."""
    code, out, _ = trio_cli(capsys, "usage", *world.alice)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["RUN", "TRAINED", "PREFILLED", "SAMPLED", "TOTAL"] and lines[-1] == "budget: no limit"
    usage = world.service.create_rest_client().get_usage()
    for run in usage.runs:
        assert next(line for line in lines if line.startswith(run.run_id or "(base")).split()[-1] == f"{run.total:,}"
    assert {r.run_id for r in usage.runs} >= {run_id for run_id, *_ in world.runs.values()}
    assert lines[-2].split() == ["TOTAL", f"{usage.trained:,}", f"{usage.prefilled:,}", f"{usage.sampled:,}",
                                 f"{usage.total:,}"] and usage.trained > 0
    code, out, _ = trio_cli(capsys, "usage", *world.bob)
    assert code == 0 and out.splitlines()[1].split() == ["TOTAL", "0", "0", "0", "0"]


def test_checkpoints_list(world, capsys):
    run_id, sampler, state, _ = world.runs[(TINY, True)]
    code, out, _ = trio_cli(capsys, "checkpoints", "list", run_id, *world.alice)
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["PATH", "KIND", "SIZE", "CREATED", "(UTC)"]
    by_path = {row.split()[0]: row.split() for row in rows}
    assert set(by_path) == {sampler, state}
    assert by_path[sampler][1] == "sampler_weights" and by_path[state][1] == "weights"
    for fields in by_path.values():
        assert fields[3] in ("KiB", "MiB") and float(fields[2]) > 0, fields  # e.g. "1.4 MiB"
    # the state (adapter + optimizer moments) is about three times the sampler weights
    state_kib = float(by_path[state][2]) * (1024 if by_path[state][3] == "MiB" else 1)
    sampler_kib = float(by_path[sampler][2]) * (1024 if by_path[sampler][3] == "MiB" else 1)
    assert 2.5 < state_kib / sampler_kib < 3.5
    # without a run: every checkpoint of alice's
    code, out, _ = trio_cli(capsys, "checkpoints", "list", *world.alice)
    assert code == 0 and all(s in out and p in out for _, s, p, _ in world.runs.values())


def test_an_unknown_or_foreign_run_is_an_error_that_names_it(world, capsys):
    run_id = world.runs[(TINY, True)][0]
    for who, run in ((world.alice, "run-0000"), (world.bob, run_id)):
        code, out, err = trio_cli(capsys, "checkpoints", "list", run, *who)
        assert code == 1 and out == ""
        assert f"training run '{run}' not found" in err and "belongs to this API key" in err


def test_download_shows_progress_and_resumes(world, capsys, tmp_path):
    _, _, state, _ = world.runs[(TIED, True)]
    code, out, err = trio_cli(capsys, "checkpoints", "download", state, str(tmp_path), *world.alice)
    assert code == 0
    archive = Path(out.strip())
    assert archive.parent == tmp_path and archive.name.endswith("-weights-ckpt-2.tar")
    assert "100%" in err and archive.name in err  # tqdm's bar, on stderr
    full = archive.read_bytes()
    with tarfile.open(archive) as tar:
        assert sorted(Path(n).name for n in tar.getnames()) == [
            "adapter.safetensors", "ckpt-2", "optimizer.safetensors", "trio_state.json"]

    # An earlier download stopped after a third: the command fetches only the rest. The
    # kept part is zeroed here, so a fresh download would show up as different bytes.
    etag = httpx.get(world.server.url + "/api/v1/checkpoints/archive", params={"path": state},
                     headers={"Authorization": f"Bearer {world.alice_key}"}).headers["etag"]
    again = tmp_path / "again"
    again.mkdir()
    cut = len(full) // 3
    (again / (archive.name + ".part")).write_bytes(bytes(cut))
    (again / (archive.name + ".part.etag")).write_text(etag)
    code, out, _ = trio_cli(capsys, "checkpoints", "download", state, str(again), "--quiet", *world.alice)
    assert code == 0
    assert Path(out.strip()).read_bytes() == bytes(cut) + full[cut:]
    assert sorted(p.name for p in again.iterdir()) == [archive.name]


def test_ctrl_c_is_one_line_not_a_traceback(world, capsys, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trio.RestClient, "download_checkpoint_archive", interrupted)
    _, _, state, _ = world.runs[(TIED, True)]
    code, out, err = trio_cli(capsys, "checkpoints", "download", state, str(tmp_path), *world.alice)
    assert (code, out, err) == (130, "", "trio: interrupted\n")


def test_download_dest_a_new_folder_by_its_slash_or_a_file_in_a_missing_folder(world, capsys, tmp_path):
    _, _, state, _ = world.runs[(TIED, True)]
    tinker_path = state.replace("trio://", "tinker://")  # the tinker SDK's name for it
    code, out, _ = trio_cli(capsys, "checkpoints", "download", tinker_path, str(tmp_path / "new") + "/", "--quiet",
                            *world.alice)
    assert code == 0 and Path(out.strip()).parent == tmp_path / "new" and Path(out.strip()).is_file()
    code, _, err = trio_cli(capsys, "checkpoints", "download", state, str(tmp_path / "absent" / "x.tar"), "--quiet",
                            *world.alice)
    assert code == 1 and err.startswith("trio: error:") and "absent" in err and "does not exist" in err


def test_download_failures_say_what_to_do_in_a_line(world, capsys, tmp_path, monkeypatch):
    """A destination that cannot be written gave a traceback; a server that is not there
    was an 'interrupted' download to resume, though nothing had started; a URL that is not
    a TRIO server's printed its HTML page."""
    import errno

    import httpx

    _, _, state, _ = world.runs[(TIED, True)]

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(trio.RestClient, "download_checkpoint_archive", disk_full)
        code, _, err = trio_cli(capsys, "checkpoints", "download", state, str(tmp_path), *world.alice)
    assert code == 1 and err.count("\n") == 1
    assert f"cannot write the archive to {tmp_path}: No space left on device" in err and "resume" in err
    code, _, err = trio_cli(capsys, "checkpoints", "download", state, str(tmp_path), "--quiet",
                            "--base-url", "http://127.0.0.1:1", "--api-key", world.alice_key)
    assert code == 1 and "cannot reach the service to download" in err and "interrupted" not in err

    def a_web_page(request):
        return httpx.Response(404, text="<!DOCTYPE HTML><html><body>Not Found</body></html>")

    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(a_web_page), **kw))
    code, _, err = trio_cli(capsys, "runs", "list", "--base-url", "http://elsewhere.test", "--api-key", "k")
    assert code == 1 and "404 Not Found from http://elsewhere.test" in err and "an HTML page, not a TRIO reply" in err
    assert "DOCTYPE" not in err


def test_delete(world, capsys):
    tc = world.service.create_lora_training_client(base_model=TINY, rank=2)
    path = tc.save_weights_for_sampler("to-delete").result().path
    code, _, err = trio_cli(capsys, "checkpoints", "delete", path, *world.bob)  # not bob's
    assert code == 1 and f"checkpoint '{path}' not found" in err and "belongs to this API key" in err
    assert any(c.path == path for c in world.service.create_rest_client().list_user_checkpoints())
    code, out, _ = trio_cli(capsys, "checkpoints", "delete", path, *world.alice)
    assert code == 0 and out.strip() == f"deleted {path}"
    code, out, _ = trio_cli(capsys, "checkpoints", "list", tc.model_id, *world.alice)
    assert code == 0 and path not in out
    code, _, err = trio_cli(capsys, "checkpoints", "delete", path, *world.alice)  # gone
    assert code == 1 and "not found" in err
    code, _, err = trio_cli(capsys, "checkpoints", "delete", "not-a-path", *world.alice)
    assert code == 1 and "'not-a-path' is not a checkpoint path" in err


@pytest.fixture(scope="module")
def exports(world, tmp_path_factory):
    """Each case's sampler weights exported with and without --merge, through the CLI."""
    out = tmp_path_factory.mktemp("exports")
    done = {}
    for case, (_, sampler, _, _) in world.runs.items():
        tag = f"{case[0].split('/')[1]}-{case[1]}"
        for merge in (True, False):
            folder = out / f"{tag}-{'merged' if merge else 'peft'}"
            try:
                main(["export", sampler, str(folder), *(["--merge"] if merge else []), *world.alice])
            except SystemExit as exc:
                pytest.fail(f"trio export {sampler} exited with {exc.code}")
        done[case] = (out / f"{tag}-merged", out / f"{tag}-peft")
    return done


def base_model(world, name):
    from transformers import AutoModelForCausalLM

    if name == TINY:
        return plain_model(name)
    return AutoModelForCausalLM.from_pretrained(world.moe_folder if name == MOE else world.tied_folder)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_merged_export_decodes_as_trio(world, exports, case):
    """from_pretrained(OUT) greedy = TRIO's greedy sampler on the same weights, and not the
    base model's; its logprobs are TRIO's; its weights are W0 + (α/r)·B·A."""
    from transformers import AutoModelForCausalLM

    merged_dir, peft_dir = exports[case]
    _, sampler_path, _, data = world.runs[case]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    eager = {"experts_implementation": "eager"} if case[0] == MOE else {}  # grouped_mm has no fp64
    merged64 = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float64, **eager)
    sampler = world.service.create_sampling_client(model_path=sampler_path)
    base_sampler = world.service.create_sampling_client(base_model=case[0])
    eos = merged.generation_config.eos_token_id
    differs = 0
    for prompt, completion in data:
        n = len(completion)
        ours = greedy_trio(sampler, prompt, n)
        assert greedy_hf(merged, prompt, n, eos) == ours
        # Equal greedy outputs mean something only where no step was a near tie that fp32
        # rounding (~1e-6 here) could flip either way; the training makes the gaps wide.
        assert min(greedy_gaps(merged, prompt, ours)) > 1e-4
        differs += greedy_trio(base_sampler, prompt, n) != ours
        # TRIO's logprobs: as near the merged model's in fp64 as that model's own in fp32
        # are, give or take (a trained adapter can make a position sensitive: plain fp32
        # transformers was 4e-4 off there once)
        trio_lp = torch.tensor(sampler.compute_logprobs(trio.ModelInput.from_ints(prompt + completion)).result()[1:],
                               dtype=torch.float64)
        exact = logprobs_hf(merged64, prompt + completion)
        fp32_error = (logprobs_hf(merged, prompt + completion) - exact).abs()
        assert ((trio_lp - exact).abs() <= 2e-4 + 3 * fp32_error).all(), (trio_lp - exact, fp32_error)
    assert differs == len(data)

    # the weights, by hand, for one attention layer and the unembedding
    adapter = load_file(peft_dir / "adapter_model.safetensors")
    weights = load_file(merged_dir / "model.safetensors")
    base = base_model(world, case[0]).state_dict()
    prefix = "base_model.model."
    for module in ("model.layers.1.self_attn.v_proj", "lm_head"):
        a, b = adapter.get(f"{prefix}{module}.lora_A.weight"), adapter.get(f"{prefix}{module}.lora_B.weight")
        if module == "lm_head" and not case[1]:
            assert a is None and torch.equal(merged.lm_head.weight, base["lm_head.weight"])
            continue
        assert b.abs().max() > 1e-2  # trained: B is far from its zero init
        key = module + ".weight"
        w0 = base[key] if key in base else base["model.embed_tokens.weight"]
        torch.testing.assert_close(weights.get(key, weights.get("model.embed_tokens.weight")),
                                   w0 + 32.0 / 8 * (b @ a), atol=1e-6, rtol=0)
    if case[0] == MOE:  # each expert's weights: W0[e] + (α/r)·B_e·A_e, from peft's layout by its formula
        module, experts = "model.layers.1.mlp.experts", 4
        key = module + ".down_proj"  # peft's outer wrapper; gate_up_proj's sit under base_layer
        a, b = adapter[f"{prefix}{module}.lora_A.weight"], adapter[f"{prefix}{module}.lora_B.weight"]
        delta = torch.einsum("ore,eri->eoi", b.reshape(b.shape[0], -1, experts), a.reshape(experts, -1, a.shape[1]))
        assert b.abs().max() > 1e-2
        # (the file keeps transformers' per-expert checkpoint layout: read the loaded model's tensor)
        torch.testing.assert_close(merged.state_dict()[key], base[key] + 32.0 / 8 * delta, atol=1e-6, rtol=0)
    assert torch.equal(merged.model.embed_tokens.weight, base["model.embed_tokens.weight"])
    tied = case[0] == TIED and not case[1]
    assert (merged.lm_head.weight is merged.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_peft_export_loads_in_peft_with_the_merged_logits(world, exports, case):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    merged_dir, peft_dir = exports[case]
    assert sorted(p.name for p in peft_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert ("lm_head" in config["target_modules"]) == case[1] and config["r"] == 8
    # in fp64: the runs' adapters (learning rate 0.05 on a random tiny model) leave it so
    # ill-conditioned that fp32's own rounding moved the unembed case's logits by 1.5e-4
    # (peft in fp32 against peft in fp64); what is left is the merged file's fp32 rounding.
    # (The experts' grouped kernel takes no fp64; that model's logits moved 1e-5.)
    dtype = torch.float32 if case[0] == MOE else torch.float64
    model = peft.PeftModel.from_pretrained(base_model(world, case[0]).to(dtype), str(peft_dir)).to(dtype)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).to(dtype)
    ids = torch.tensor([sum(world.runs[case][3][0], [])])
    with torch.no_grad():
        theirs, ours = model(input_ids=ids).logits, merged(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


def test_merged_folder_is_a_standalone_model(world, exports):
    merged_dir = exports[(TIED, True)][0]
    names = {p.name for p in merged_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    assert json.loads((merged_dir / "generation_config.json").read_text())["max_length"] == 321  # the base's
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(merged_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in chat
    assert "generation_config.json" not in {p.name for p in exports[(TINY, True)][0].iterdir()}  # tiny has none


def test_export_of_training_state_equals_export_of_sampler_weights(world, exports, capsys, tmp_path):
    _, _, state, _ = world.runs[(TIED, True)]
    code, out, err = trio_cli(capsys, "export", state, str(tmp_path / "peft"), *world.alice)
    assert code == 0 and out.strip() == str(tmp_path / "peft")
    a = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    b = load_file(exports[(TIED, True)][1] / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_into_the_empty_working_folder_readable_by_all(world, capsys, tmp_path, monkeypatch):
    """``trio export PATH .`` in a new empty folder; the files get the umask's modes
    (safetensors writes its files 0600), and the tokenizer and RoPE settings are written so
    that transformers 4 loads them too."""
    _, sampler, _, _ = world.runs[(TIED, True)]
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    old = os.umask(0o022)
    try:
        code, out, err = trio_cli(capsys, "export", sampler.replace("trio://", "tinker://"), ".", "--merge",
                                  *world.alice)
    finally:
        os.umask(old)
    assert code == 0, err
    assert Path.cwd() == here and (here / "model.safetensors").exists()  # written into it, not beside it
    assert {oct(p.stat().st_mode & 0o777) for p in here.iterdir()} == {"0o644"}
    assert json.loads((here / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    config = json.loads((here / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    (tmp_path / "afile").write_text("")
    code, _, err = trio_cli(capsys, "export", sampler, str(tmp_path / "afile" / "sub"), *world.alice)
    assert code == 1 and "is a file, not a folder" in err


def test_export_errors_name_what_is_wrong(world, capsys, tmp_path, monkeypatch):
    _, sampler, _, _ = world.runs[(TIED, True)]
    # someone else's checkpoint, and one that does not exist
    code, _, err = trio_cli(capsys, "export", sampler, str(tmp_path / "x"), *world.bob)
    assert code == 1 and f"checkpoint '{sampler}' not found" in err and "belongs to this API key" in err
    code, _, err = trio_cli(capsys, "export", sampler + "-nope", str(tmp_path / "x"), "--merge", *world.alice)
    assert code == 1 and "not found" in err
    # a full output folder is refused before anything is downloaded
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("")
    code, _, err = trio_cli(capsys, "export", sampler, str(tmp_path / "full"), *world.alice)
    assert code == 1 and "full: exists and is not an empty folder" in err
    assert ".tar" not in err  # no download progress bar
    # the base model is not on this machine (the server has it; this client does not)
    monkeypatch.delenv("TRIO_MODELS")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = trio_cli(capsys, "export", sampler, str(tmp_path / "m"), "--merge", *world.alice)
    assert code == 1 and "--merge needs the base model's weights on this machine" in err and TIED in err
    assert not (tmp_path / "m").exists()
    # no engine (torch) here at all: it cannot be imported (the request fails before any
    # is sent, so the server in this process never notices)
    monkeypatch.setitem(sys.modules, "trio_engine", None)
    code, _, err = trio_cli(capsys, "export", sampler, str(tmp_path / "m"), *world.alice)
    assert code == 1 and "pip install 'trio-platform[server]'" in err
    # a key but no server to send it to
    code, _, err = trio_cli(capsys, "runs", "list", "--api-key", "k")
    assert code == 1 and "--api-key given but no service" in err


def test_a_wrong_key_is_an_authentication_error(world, capsys):
    code, out, err = trio_cli(capsys, "runs", "list", "--base-url", world.server.url, "--api-key", "wrong")
    assert code == 1 and out == "" and err.startswith("trio: error:") and "key" in err.lower()


# --------------------------------------------------------------------------- embedded


@pytest.fixture
def embedded_home(tmp_path, monkeypatch):
    """A fresh embedded service under TRIO_HOME=tmp_path, sharing the converted model cache."""
    from pytrio.transport import local

    models = Path(os.environ.get("TRIO_HOME") or Path.home() / ".cache" / "trio") / "models"
    for name in ("PYTRIO_BASE_URL", "PYTRIO_API_KEY", "TRIO_MODELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRIO_HOME", str(tmp_path))
    if models.exists():
        (tmp_path / "models").symlink_to(models)
    yield tmp_path
    core = local._cores.pop(str(tmp_path / "embedded"), None)
    if core is not None:
        core.close()


def test_embedded_service(embedded_home, capsys):
    """With no URL the commands use the embedded service, as ``trio.ServiceClient()`` does."""
    service = trio.ServiceClient()
    run_id, sampler_path, state, data = train(service, TINY, True, name="emb", steps=6)
    code, out, _ = trio_cli(capsys, "runs", "list")
    assert code == 0 and run_id in out and TINY in out
    code, out, _ = trio_cli(capsys, "checkpoints", "list", run_id)
    assert code == 0 and sampler_path in out and state in out

    code, out, _ = trio_cli(capsys, "export", sampler_path, str(embedded_home / "merged"), "--merge")
    assert code == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(embedded_home / "merged")
    sampler = service.create_sampling_client(model_path=sampler_path)
    prompt, completion = data[0]
    assert greedy_hf(merged, prompt, len(completion), 2) == greedy_trio(sampler, prompt, len(completion))

    code, out, _ = trio_cli(capsys, "checkpoints", "download", state, str(embedded_home))
    assert code == 0 and Path(out.strip()).exists()
    code, _, err = trio_cli(capsys, "checkpoints", "delete", "trio://run-00/weights/none")
    assert code == 1 and "nothing of that name belongs to the embedded service" in err
    code, _, _ = trio_cli(capsys, "checkpoints", "delete", state)
    assert code == 0

    # the installed entry point, in another process on the same data dir
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "trio_cli", "checkpoints", "list"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sampler_path in done.stdout and state not in done.stdout


@pytest.mark.slow
def test_bundled_smollm2_with_tied_embeddings(embedded_home, capsys):
    """The real case behind the untying: SmolLM2-135M ties lm_head to embed_tokens. Its
    merged export (lm_head trained) decodes as TRIO does, with the input embeddings intact."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from trio_engine import DEFAULT_MODEL

    service = trio.ServiceClient()
    _, sampler_path, _, data = train(service, DEFAULT_MODEL, True, name="smol", steps=3)
    code, _, err = trio_cli(capsys, "export", sampler_path, str(embedded_home / "merged"), "--merge")
    assert code == 0, err
    assert "untying it from the input embeddings" in err
    merged = AutoModelForCausalLM.from_pretrained(embedded_home / "merged")
    assert merged.lm_head.weight is not merged.model.embed_tokens.weight
    base_folder = embedded_home / "models" / DEFAULT_MODEL.replace("/", "--")
    with safe_open(base_folder / "model.safetensors", "pt") as base:
        assert torch.equal(merged.model.embed_tokens.weight, base.get_tensor("model.embed_tokens.weight"))
    sampler = service.create_sampling_client(model_path=sampler_path)
    base_sampler = service.create_sampling_client(base_model=DEFAULT_MODEL)
    differs = 0
    for prompt, _ in data:
        ours = greedy_trio(sampler, prompt, 8)
        assert greedy_hf(merged, prompt, 8, merged.generation_config.eos_token_id) == ours
        assert min(greedy_gaps(merged, prompt, ours)) > 1e-4
        differs += greedy_trio(base_sampler, prompt, 8) != ours
    assert differs > 0


def test_a_key_in_the_environment_without_a_url_is_said_to_meet_the_embedded_service(embedded_home, capsys,
                                                                                       monkeypatch):
    monkeypatch.setenv("PYTRIO_API_KEY", "trio-for-a-server")
    code, _, err = trio_cli(capsys, "runs", "list")
    assert code == 0 and "PYTRIO_API_KEY is set but no --base-url or PYTRIO_BASE_URL: this is the embedded" in err


def test_no_url_and_no_embedded_service_says_what_is_missing(embedded_home, capsys, monkeypatch):
    """An SDK-only install (no server dependencies) with no URL: the error says both ways out."""
    monkeypatch.setitem(sys.modules, "trio_server.core", None)  # as if its imports failed
    code, out, err = trio_cli(capsys, "runs", "list")
    assert code == 1 and out == ""
    assert "no --base-url or PYTRIO_BASE_URL, and the embedded service cannot run here" in err
    assert "pip install 'trio-platform[server]'" in err
