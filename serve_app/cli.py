"""Command line: ``python -m serve_app generate PROMPT [...]``, ``distill``, ``check-draft``, ``compile``, ``tune``,
``stop``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from serve_app.config import EngineConfig, SpeculationConfig, auto_speculation
from serve_app.engine.engine import RequestError
from serve_app.engine.request import GenerationParams
from serve_app.models.base import ModelLoadError
from serve_app.models.dtype import DTYPE_NAMES
from serve_app.models.sources import DEFAULT_MODEL, ModelSourceError
from serve_app.speculation.types import SamplingParams


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt with speculative decoding")
    p.add_argument("prompt")
    p.add_argument("--model", default=DEFAULT_MODEL, help="target: HF folder, .gguf file or embedded name")
    p.add_argument("--draft", default="auto",
                   help="draft model source, 'ngram', 'none' or 'auto': for the embedded model its shipped EAGLE "
                        "head with --ngram-first and --draft-stop-below 0.5, n-gram lookup for other models")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="block size k (0 = plain decoding)")
    p.add_argument("--ngram-first", action="store_true",
                   help="with a draft model: n-gram lookup where the context matches, the draft elsewhere")
    p.add_argument("--draft-stop-below", type=float, default=None,
                   help="a draft model stops a block after a token it gave less than this probability")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filtering")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="bfloat16")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check_sampling(args: argparse.Namespace) -> None:
    if args.temperature < 0:
        raise SystemExit("--temperature must be >= 0")
    if not 0 < args.top_p <= 1:
        raise SystemExit("--top-p must be in (0, 1]")
    if args.top_k < 0:
        raise SystemExit("--top-k must be >= 0")
    if args.max_tokens < 1:
        raise SystemExit("--max-tokens must be >= 1")


def speculation(args: argparse.Namespace) -> dict:
    keys = auto_speculation(args.model) if args.draft == "auto" else {"draft": args.draft}
    if args.ngram_first:
        keys["ngram_first"] = True
    if args.draft_stop_below is not None:
        keys["draft_stop_below"] = args.draft_stop_below
    return keys


def generate(args: argparse.Namespace) -> int:
    from serve_app.engine.factory import build_engine  # torch import only when needed

    _check_sampling(args)
    try:
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_batch_size=1,
            max_seq_len=4096,
            num_threads=args.threads,
            speculation=SpeculationConfig(num_speculative_tokens=args.num_speculative_tokens, **speculation(args)),
        )
        engine = build_engine(config)
    except ValidationError as e:
        raise SystemExit(f"invalid option: {e.errors()[0]['loc'][-1]}: {e.errors()[0]['msg']}") from e
    except (ModelSourceError, ModelLoadError) as e:
        raise SystemExit(str(e)) from e
    tokenizer = engine.tokenizer
    if args.chat:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:
        ids = tokenizer.encode(args.prompt)
    params = GenerationParams(
        max_tokens=args.max_tokens,
        sampling=SamplingParams(args.temperature, args.top_p, args.top_k, args.seed),
        stop=tuple(args.stop),
    )
    try:
        out = engine.generate([ids], params)[0]
    except RequestError as e:
        raise SystemExit(str(e)) from e
    if args.json:
        print(json.dumps(out.as_dict()))
    else:
        print(out.text)
        s = out.stats
        print(
            f"\n[{len(out.token_ids)} tokens, {out.tokens_per_second:.1f} tok/s, finish={out.finish_reason}, "
            f"acceptance {s.acceptance_rate:.2f}, mean acceptance length {s.mean_acceptance_length:.2f}, "
            f"target passes {s.target_forward_passes}]",
            file=sys.stderr,
        )
    return 0


def _distill_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("distill", help="train a draft for a target by distillation (resumable)")
    p.add_argument("--target", default=DEFAULT_MODEL, help="target model source")
    p.add_argument("--out", required=True, help="work folder; the draft lands in OUT/draft")
    p.add_argument("--minutes", type=float, default=60.0, help="training time budget")
    p.add_argument("--unroll", type=int, default=4,
                   help="eagle: drafting steps trained, each reading the previous step's prediction "
                        "(1: true features only)")
    p.add_argument("--taps", default=None,
                   help="eagle: comma-separated layer counts after which the target's residual stream is fused "
                        "with its final state (EAGLE-3); 'none' for the final state alone; default: the --init "
                        "head's, else after 2 and half of the target's layers")
    p.add_argument("--init", default=None, help="start from this trained draft folder (same target and data)")
    p.add_argument("--max-steps", type=int, default=None, help="also stop after N steps (schedule by steps)")
    p.add_argument("--arch", choices=["eagle", "decoder"], default="eagle",
                   help="eagle: a one-layer head on the target's hidden states; decoder: a standalone small decoder")
    p.add_argument("--vocab-size", type=int, default=8192, help="draft output vocabulary (most frequent tokens)")
    p.add_argument("--max-prompts", type=int, default=None, help="cap on training prompts")
    p.add_argument("--samples-per-prompt", type=int, default=2, help="1 greedy + N-1 sampled responses")
    p.add_argument("--synth-prompts", type=int, default=0,
                   help="also train on up to N user prompts the target writes itself (Magpie)")
    p.add_argument("--gen-batch", type=int, default=32, help="batch size of the response generation")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--text-docs", type=int, default=600, help="stdlib docstrings used as plain text")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=None)


def _taps(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise SystemExit(f"--taps {text!r}: expected comma-separated layer counts such as 2,15, or none") from None


def distill(args: argparse.Namespace) -> int:
    import torch

    from serve_app.distill.train import DistillConfig
    from serve_app.distill.train import distill as run

    if args.threads:
        torch.set_num_threads(args.threads)
    run(DistillConfig(
        target=args.target, out=Path(args.out), minutes=args.minutes, max_steps=args.max_steps, arch=args.arch,
        vocab_size=args.vocab_size, unroll=args.unroll, init=Path(args.init) if args.init else None,
        taps=_taps(args.taps),
        max_prompts=args.max_prompts, samples_per_prompt=args.samples_per_prompt, synth_prompts=args.synth_prompts,
        gen_batch=args.gen_batch,
        max_new_tokens=args.max_new_tokens, text_docs=args.text_docs, batch_size=args.batch_size, lr=args.lr,
        eval_every=args.eval_every,
    ))
    return 0


def _check_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-draft", help="check that a draft can serve a target (tokenizer, specials, vocab)")
    p.add_argument("--target", default=DEFAULT_MODEL)
    p.add_argument("--draft", required=True)


def check(args: argparse.Namespace) -> int:
    from serve_app.engine.plan import check_pair
    from serve_app.speculation.compatibility import DraftMismatchError

    try:
        notes = check_pair(args.target, args.draft)
    except (DraftMismatchError, ModelSourceError) as e:
        raise SystemExit(str(e)) from e
    print(f"ok: {args.draft} can draft for {args.target}")
    for note in notes:
        print(f"  note: {note}")
    return 0


def _compile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compile", help="compile a Serve config's target and draft for Neuron (NxDI artifacts)")
    p.add_argument("config", help="Serve config file (configs/trn2-*.yaml) or a file holding its args")
    p.add_argument("--app", default=None, help="application name, when the file has several")


def compile_models(args: argparse.Namespace) -> int:
    from serve_app.builder import ConfigError
    from serve_app.compile import compile_config

    logging.getLogger("serve_app").setLevel(logging.INFO)
    try:
        compile_config(Path(args.config), args.app)
    except (ConfigError, ModelLoadError, ModelSourceError, ValueError, OSError) as e:
        raise SystemExit(f"compile: {e}") from e
    return 0


def _tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="measure acceptance and costs on your prompts; recommend k and overlap")
    p.add_argument("config", help="Serve config file (configs/*.yaml) or a file holding its args")
    p.add_argument("--app", default=None, help="application name, when the file has several")
    p.add_argument("--prompts", default=None,
                   help="a file of prompts, one per line (default: held-out chat prompts of the distillation set)")
    p.add_argument("--raw", action="store_true", help="send the prompts as they are, without the chat template")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,4", help="batch sizes to measure, comma separated")
    p.add_argument("--out", default="tune-results", help="folder for tune.json and the plots")
    p.add_argument("--project", choices=["trn2", "none"], default="trn2",
                   help="project another machine from per-component costs (default: the Trainium2 reference pair)")
    p.add_argument("--project-costs", default=None,
                   help="override the projection's costs in seconds: verify_fixed=..,verify_per_token=..,"
                        "draft_step=..,exchange=..")
    p.add_argument("--project-acceptance", default=None,
                   help="acceptance per draft position for the projection, comma separated (default: measured here)")


def tune(args: argparse.Namespace) -> int:
    from serve_app.builder import ConfigError, load_app_config
    from serve_app.distill.prompts import chat_prompts
    from serve_app.tune import Projection
    from serve_app.tune import tune as run_tune

    try:
        app = load_app_config(Path(args.config), args.app)
        if not isinstance(app.engine, EngineConfig):
            raise ValueError("tune measures this project's engine (engine.kind: disaggregated); vLLM's engine has "
                             "its own speculation settings")
        batches = [int(b) for b in args.batches.split(",")]
        prompts = (Path(args.prompts).read_text().splitlines() if args.prompts else chat_prompts("heldout"))
        prompts = [p for p in prompts if p.strip()][: args.num_prompts]
        if not prompts or min(batches) < 1:
            raise ValueError("need at least one prompt and batch sizes >= 1")
        projection = None
        if args.project == "trn2":
            projection = Projection.trn2_reference()
            if args.project_costs:
                costs = {k: float(v) for k, v in (kv.split("=") for kv in args.project_costs.split(","))}
                projection = Projection(**{**projection.__dict__, **costs, "name": "your machine",
                                           "source": "--project-costs"})
        alphas = [float(a) for a in args.project_acceptance.split(",")] if args.project_acceptance else None
        run_tune(app.engine, prompts, chat=not args.raw, max_tokens=args.max_tokens, batches=batches,
                 out=Path(args.out), projection=projection, projection_alphas=alphas)
    except (ConfigError, ModelLoadError, ModelSourceError, ValueError, TypeError, OSError) as e:
        raise SystemExit(f"tune: {e}") from e
    return 0


def _stop_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stop", help="stop this machine's `serve run` as Ctrl-C does: drain, delete the app, exit")
    p.add_argument("--wait", type=float, default=15.0,
                   help="seconds serve run gets to exit after each signal, once its apps are drained (default 15)")


def stop(args: argparse.Namespace) -> int:
    from serve_app.serving.stop import stop as stop_serve_run

    stopped = stop_serve_run(args.wait)
    for pid, how in stopped:
        print(f"serve run (pid {pid}): {how}")
    if not stopped:
        print("no `serve run` process on this machine (apps deployed with `serve deploy` or KubeRay: "
              "`serve shutdown -y`)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m serve_app", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _distill_parser(sub)
    _check_parser(sub)
    _compile_parser(sub)
    _tune_parser(sub)
    _stop_parser(sub)
    args = parser.parse_args(argv)
    commands = {"generate": generate, "distill": distill, "check-draft": check, "compile": compile_models,
                "tune": tune, "stop": stop}
    return commands[args.command](args)
