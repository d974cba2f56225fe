"""The ``tokenloom`` command. Each command parses options and calls one library function.

User errors (:class:`tokenloom.errors.TokenloomError`) are printed as one line on
stderr with a non-zero exit status; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import os
import signal
import sys
from pathlib import Path


def _import_numpy_with_one_blas_thread() -> None:
    """Import numpy with OpenBLAS limited to one thread, then restore the environment: no command
    uses numpy's BLAS, and its spinning threads would take the input hasher's core."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # lazy: must load after OPENBLAS_NUM_THREADS is set above  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


_import_numpy_with_one_blas_thread()

import click  # noqa: E402

from tokenloom.errors import Stopped, TokenloomError  # noqa: E402


class _Group(click.Group):
    """A click group that turns user errors into one-line messages."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TokenloomError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            click.echo(f"error: {exc.strerror}: {exc.filename}", err=True)
            sys.exit(1)
        except BrokenPipeError:
            _silence_stdout()
            click.echo("error: standard output was closed before the command finished (broken pipe); "
                       "rerun the same command with its output going to a file or a terminal", err=True)
            sys.exit(1)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the final flush to a closed pipe prints no second message (SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _Greedy(click.Option):
    """A ``multiple`` option that also takes the values following it (argparse's ``nargs='+'``, as in
    Megatron's scripts), up to the next option-like token (``-0.5`` is a value)."""

    def add_to_parser(self, parser, ctx):
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            opt = parser._long_opt.get(name) or parser._short_opt.get(name)
            if opt is None:
                continue
            process = opt.process

            def greedy(value, state, process=process):
                process(value, state)
                while state.rargs and not _looks_like_option(state.rargs[0]):
                    process(state.rargs.pop(0), state)

            opt.process = greedy


def _looks_like_option(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
        return False
    except ValueError:
        return True


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tokenloom")
def main():
    """tokenloom: raw text -> Megatron .bin/.idx -> blends -> a trained GPT."""


@main.command()
def info():
    """Print versions, the native extension's state and the torch devices/backends."""
    from tokenloom.info import collect  # lazy: start-up time

    facts = collect()
    width = max(map(len, facts))
    for key, value in facts.items():
        click.echo(f"{key:<{width}}  {value}")


def _pair(on: str, default_on: bool, off_flag: str, off: str) -> str:
    """The help of a ``--x/--no-x`` pair: what each form does, and which one is the default."""
    on, off = on.rstrip("."), off.rstrip(".")
    return f"{on}{' (the default)' if default_on else ''}. {off_flag}: {off}{'' if default_on else ' (the default)'}."


def _emit(report: dict, as_json: bool) -> None:
    """Print a report as JSON or as aligned ``key  value`` lines."""
    from tokenloom.indexed.tools import format_report  # lazy: start-up time

    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))


@main.command()
@click.argument("prefix")
@click.option("--hash/--no-hash", "with_hash", default=True,
              help=_pair("Compute the token-stream SHA-256 (reads every token)", True, "--no-hash", "skip it"))
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def inspect(prefix, with_hash, as_json):
    """Counts, dtype, length distribution and token SHA-256 of PREFIX.bin/.idx."""
    from tokenloom.indexed import inspect as run  # lazy: start-up time

    _emit(run(prefix, with_hash=with_hash), as_json)


@main.command()
@click.argument("prefix")
@click.option("--vocab-size", type=int,
              help="Check that every token id is below this (default: the manifest's vocabulary).")
@click.option("--eod", type=int, help="Check that every non-empty document ends with this id "
              "(default: the manifest's EOD when the run appended one).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(prefix, vocab_size, eod, as_json):
    """Check PREFIX.bin/.idx completely, with everything PREFIX.manifest.json records (vocabulary, EOD, BOS,
    dtype, counts); exit non-zero naming the first problem."""
    from tokenloom.indexed.validate import verify_dataset  # lazy: start-up time

    report = verify_dataset(prefix, vocab_size=vocab_size, eod=eod)
    if as_json:
        _emit(report, True)
    else:
        skipped = f"; not checked: {', '.join(report['not_checked'])}" if report["not_checked"] else ""
        click.echo(f"OK {report['path_prefix']}: {report['sequences']} sequences, {report['documents']} "
                   f"documents, {report['tokens']} tokens ({report['dtype']}); checked "
                   f"{', '.join(report['checked'])}{skipped}")


@main.command()
@click.option("--output-prefix", required=True, help="Prefix of the merged PREFIX.bin/.idx.")
@click.argument("prefixes", nargs=-1, required=True)
def merge(output_prefix, prefixes):
    """Concatenate datasets PREFIXES (in order) into one, manifests too; dtypes and tokenizers must agree."""
    from tokenloom.preprocess.merge import merge as run  # lazy: start-up time

    _emit(run(output_prefix, list(prefixes)), False)


def _help(cls_path: str, name: str) -> str:
    """The ``--help`` text of config field ``name`` of class ``module:Class`` (read without importing it)."""
    from tokenloom.config import source_field_docs  # lazy: start-up time

    return source_field_docs(cls_path)[name]


def _pp_help(name: str) -> str:
    return _help("tokenloom.preprocess.config:PreprocessConfig", name)


@main.command()
@click.option("--input", "inputs", cls=_Greedy, multiple=True, required=True, help=_pp_help("inputs"))
@click.option("--output-prefix", required=True, help=_pp_help("output_prefix"))
@click.option("--tokenizer", "--tokenizer-model", "tokenizer", help=_pp_help("tokenizer"))
@click.option("--tokenizer-type", help=_pp_help("tokenizer_type"))
@click.option("--tokenizer-backend", type=click.Choice(["auto", "reference", "gigatoken"]), default="auto",
              show_default=True, help="Tokenizer engine: auto (gigatoken when its self-check on load finds the "
              "reference library's ids, else the reference library), reference, or gigatoken (fail if it cannot "
              "be used). The manifest records which ran and why; the ids are the same.")
@click.option("--json-keys", cls=_Greedy, multiple=True, default=("text",), show_default=True,
              help=_pp_help("json_keys"))
@click.option("--append-eod", is_flag=True, help=_pp_help("append_eod"))
@click.option("--prepend-bos", is_flag=True, help=_pp_help("prepend_bos"))
@click.option("--workers", type=int, default=0, show_default=True, help=_pp_help("workers"))
@click.option("--txt-unit", type=click.Choice(["file", "paragraph", "line"]), default="file", show_default=True,
              help=_pp_help("txt_unit"))
@click.option("--megatron-names", is_flag=True, help=_pp_help("megatron_names"))
@click.option("--num-shards", type=int, help=_pp_help("num_shards"))
@click.option("--shard-index", type=int, help=_pp_help("shard_index"))
@click.option("--max-bad-fraction", type=float, help=_pp_help("max_bad_fraction"))
@click.option("--chunk-bytes", type=int, default=4 << 20, show_default=True, help=_pp_help("chunk_bytes"))
@click.option("--checkpoint-interval", type=float, default=60.0, show_default=True,
              help=_pp_help("checkpoint_interval"))
@click.option("--encoder-memory-mb", type=click.IntRange(min=0), default=128, show_default=True,
              help=_pp_help("encoder_memory_mb"))
@click.option("--space-check/--no-space-check", "check_space", default=True,
              help=_pair(_pp_help("check_space"), True, "--no-space-check", "start without checking"))
@click.option("--progress/--no-progress", "progress", default=True,
              help=_pair(_pp_help("progress"), True, "--no-progress", "no progress bar"))
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help=_pp_help("executor"))
@click.option("--ray-address", help=_pp_help("ray_address"))
@click.option("--ray-retries", type=int, default=3, show_default=True, help=_pp_help("ray_retries"))
@click.option("--staging-dir", help=_pp_help("staging_dir"))
@click.option("--dedup", type=click.Choice(["none", "exact", "minhash"]), default="none", show_default=True,
              help=_pp_help("dedup"))
@click.option("--minhash-ngrams", type=int, default=5, show_default=True, help=_pp_help("minhash_ngrams"))
@click.option("--minhash-bands", type=int, default=14, show_default=True, help=_pp_help("minhash_bands"))
@click.option("--minhash-rows", type=int, default=8, show_default=True, help=_pp_help("minhash_rows"))
@click.option("--minhash-seed", type=int, default=1, show_default=True, help=_pp_help("minhash_seed"))
@click.option("--filter", "--filters", "filters", cls=_Greedy, multiple=True, help=_pp_help("filters"))
@click.option("--filter-param", "filter_params", multiple=True, help=_pp_help("filter_params"))
def preprocess(**options):
    """Tokenize corpora into Megatron PREFIX.bin/.idx plus PREFIX.manifest.json."""
    from tokenloom.preprocess import (  # lazy: start-up time
        PreprocessConfig,
        run,
    )
    from tokenloom.tokenizers import use_backend  # lazy: start-up time

    options["inputs"] = list(options["inputs"])
    options["json_keys"] = [k for item in options["json_keys"] for k in item.split()]
    options["filters"] = [k for item in options["filters"] for k in item.replace(",", " ").split()]
    options["filter_params"] = list(options["filter_params"])
    with use_backend(options.pop("tokenizer_backend")), _sigterm_interrupts():
        run(PreprocessConfig(**options), echo=click.echo)  # Ctrl-C / SIGTERM: checkpoint, one line


@contextlib.contextmanager
def _sigterm_interrupts(what: str | None = None):
    """SIGTERM interrupts like Ctrl-C in the block; with ``what``, it ends in one line saying so."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    except KeyboardInterrupt:
        if what is None:
            raise
        raise Stopped(f"{what} interrupted; what it wrote is whole or gone: rerun the same command",
                      signal.SIGINT) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _bd_help(name: str) -> str:
    return _help("tokenloom.blending.build:BuildConfig", name)


def _parse_counts(text: str | None) -> tuple:
    if not text:
        return (None, None, None)
    try:
        return tuple(int(x) if x.strip() else None for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected TRAIN[,VALID,TEST] integers", param_hint="--num-samples") from None


@main.command()
@click.option("--data", "--data-path", "sources", cls=_Greedy, multiple=True,
              help="Sources as WEIGHT PREFIX pairs (--data-path: Megatron's name), or prefixes alone for equal weights.")
@click.option("--blend-file", type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON blend: {data: [[w, prefix], ...]} or per split {train: [...], valid: [...], test: [...]}; "
                   "beside data a schedule: [{start_iter, blend: [[w, source], ...]}, ...] (train's data.schedule) "
                   "also builds each phase's train blend for --num-samples TRAIN.")
@click.option("--split", default="969,30,1", show_default=True, help=_bd_help("split"))
@click.option("--seq-length", type=int, default=2048, show_default=True, help=_bd_help("seq_length"))
@click.option("--num-samples", help=_bd_help("num_samples") + " Format: TRAIN[,VALID,TEST].")
@click.option("--train-tokens", type=int, help=_bd_help("train_tokens"))
@click.option("--seed", type=int, default=1234, show_default=True, help=_bd_help("seed"))
@click.option("--cache-dir", "--data-cache-path", "cache_dir", help=_bd_help("cache_dir"))
@click.option("--mode", type=click.Choice(["megatron", "tokens"]), default="megatron", show_default=True,
              help=_bd_help("mode"))
@click.option("--max-repeat", type=float, default=4.0, show_default=True, help=_bd_help("max_repeat"))
@click.option("--exhaustive", is_flag=True, help=_bd_help("exhaustive"))
@click.option("--dry-run", is_flag=True, help=_bd_help("dry_run"))
@click.option("--packing", type=click.Choice(["concat", "best-fit"]), default="concat", show_default=True,
              help=_bd_help("packing"))
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG of requested vs realised shares.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--dump-samples", "dump", type=click.Path(dir_okay=False),
              help="Write the samples of --dump-split in training order, one JSON line each: "
                   '{"sample": i, "parts": [[source, document, offset, length], ...], "padding": p}.')
@click.option("--num", "dump_num", type=click.IntRange(min=0), help="With --dump-samples: only the first N samples.")
@click.option("--dump-split", type=click.Choice(["train", "valid", "test"]), default="train", show_default=True,
              help="With --dump-samples: the split to write.")
def build(sources, blend_file, num_samples, plot, as_json, dump, dump_num, dump_split, **options):
    """Build GPT train/valid/test sample indices for a blend: build --data W1 PREFIX1 W2 PREFIX2 ..."""
    from tokenloom.blending.args import load_blend_file, parse_data_args  # lazy: start-up time
    from tokenloom.blending.build import BuildConfig, schedule_configs  # lazy: start-up time
    from tokenloom.blending.build import build as run  # lazy: start-up time
    from tokenloom.blending.dump import dump_samples  # lazy: start-up time
    from tokenloom.blending.plan import format_plan, plan_json  # lazy: start-up time
    from tokenloom.blending.plot import plot_plan  # lazy: start-up time

    if blend_file and sources:
        raise click.UsageError("give the sources either with --data or with --blend-file, not both")
    spec = load_blend_file(blend_file) if blend_file else {"data": parse_data_args(list(sources))}
    names, schedule = spec.pop("names", None), spec.pop("schedule", None)  # names: train's losses per source
    if not blend_file and not sources:
        raise click.UsageError("no sources: build --data 0.3 PREFIX1 0.7 PREFIX2 (or --blend-file FILE)")
    if "data_per_split" in spec:
        options["split"] = None
    if dump_num is not None and not dump:
        raise click.UsageError("--num goes with --dump-samples FILE")
    cfg = BuildConfig(**spec, num_samples=_parse_counts(num_samples), **options)
    phases = schedule_configs(cfg, schedule, names, blend_file) if schedule else []
    with _sigterm_interrupts("build"):  # the cache gains whole entries only (blending/cache.py)
        result = run(cfg)
        built = [(k, start, phase, run(phase)) for k, start, phase in phases]
        if dump:
            dataset = result.datasets[["train", "valid", "test"].index(dump_split)]
            if dataset is None or isinstance(dataset, list):
                raise click.UsageError(f"--dump-split {dump_split}: this blend builds no single {dump_split} dataset")
            written = dump_samples(dataset, dump, dump_num)
    if as_json and built:  # one document: the blend's plan and each phase's
        doc = json.loads(plan_json(result))
        doc["schedule"] = [{"phase": k, "start_iter": start, **json.loads(plan_json(r))} for k, start, _, r in built]
        click.echo(json.dumps(doc, indent=2))
    elif as_json:
        click.echo(plan_json(result))
    else:
        click.echo("\n".join([format_plan(result, cfg)] + [f"schedule[{k}]: from iteration {start}\n"
                                                            f"{format_plan(r, phase)}" for k, start, phase, r in built]))
    if dump and not as_json:
        click.echo(f"samples: {written} of the {dump_split} split written to {dump}")
    if plot:
        plot_plan(result, plot)
        if not as_json:
            click.echo(f"plot: {plot}")


_TRAIN, _MODEL, _OPTIM = "tokenloom.train.config:TrainConfig", "tokenloom.train.model.config:GPTConfig", \
    "tokenloom.train.optim.adamw:OptimConfig"
_NODES = "tokenloom.train.launch:Nodes"

MEGATRON_REFUSED = {
    "--fp16": "fp16 with loss scaling is not implemented; use --bf16 (or --set precision=bf16)",
    "--load": "resume with --resume auto (latest checkpoint under --output-dir) or --resume CHECKPOINT_DIR",
    "--save": "checkpoints go to OUTPUT_DIR/checkpoints; use --output-dir (or --set checkpoint_dir=DIR)",
    "--train-samples": "the run is sized in steps; use --train-iters",
    "--lr-warmup-samples": "warmup is counted in steps; use --lr-warmup-iters",
    "--lr-warmup-fraction": "warmup is counted in steps; use --lr-warmup-iters",
    "--lr-decay-samples": "the decay is counted in steps; use --lr-decay-iters",
    "--lr-wsd-decay-samples": "the decay is counted in steps; use --lr-wsd-decay-iters",
    "--recompute-activations": "use --set 'model.recompute_layers=[0, 1, ...]' (blocks to recompute)",
    "--recompute-granularity": "use --set 'model.recompute_layers=[0, 1, ...]' (whole blocks)",
    "--recompute-method": "use --set 'model.recompute_layers=[0, 1, ...]' (whole blocks)",
    "--use-flash-attn": "attention is torch's scaled_dot_product_attention, which picks flash kernels itself",
    "--transformer-impl": "tokenloom has one implementation of its own layers",
    "--use-mcore-models": "tokenloom has one implementation of its own layers",
    "--overlap-grad-reduce": "gradient buckets are always reduced while backward runs",
    "--pipeline-model-parallel-layout": "give the split as --decoder-first-pipeline-num-layers / "
                                        "--decoder-last-pipeline-num-layers, or --account-for-embedding-in-pipeline-"
                                        "split / --account-for-loss-in-pipeline-split",
    "--data-impl": "data is always Megatron's mmap .bin/.idx (removed from Megatron too)",
    "--mmap-warmup": "removed from Megatron; nothing to warm up",
    "--exit-duration-in-mins": "use --set exit_interval=N (steps)",
}
"""Megatron ``pretrain_gpt.py`` flags ``train`` refuses, each with what to do instead: their
meaning differs from anything tokenloom has, or the feature does not exist here."""


def _refused(flag: str) -> str:
    return f"{flag} (Megatron) is not supported by tokenloom train: {MEGATRON_REFUSED[flag]}"


def _megatron_refused(fn):
    for flag in MEGATRON_REFUSED:  # listed by _TrainCommand before parsing; here for the parser to know them
        fn = click.option(flag, is_flag=True, hidden=True, expose_value=False,
                          help=f"Refused (Megatron's flag): {MEGATRON_REFUSED[flag]}.")(fn)
    return fn


TRAIN_CONFLICTS = (("data", "mock_data"), ("tokenizer", "vocab_file"), ("tokenizer", "merge_file"),
                   ("vpp", "layers_per_virtual_stage"))
"""Pairs of ``train`` options (their Python names) that cannot be given together."""


class _TrainCommand(click.Command):
    """A command reporting all argument mistakes at once, before parsing: unknown flags with the
    nearest one, refused Megatron flags, conflicting pairs, misspelled config keys."""

    def parse_args(self, ctx, args):
        if not any(a in ctx.help_option_names for a in args):
            problems = self.argument_problems(ctx, args)
            if problems:
                raise click.UsageError(problems[0] if len(problems) == 1 else
                                       f"{len(problems)} problems: {'; '.join(problems)}", ctx=ctx)
        return super().parse_args(ctx, args)

    def argument_problems(self, ctx, args: list[str]) -> list[str]:
        by_flag = {o: p for p in self.get_params(ctx) for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
        valid = [o for o, p in by_flag.items() if not getattr(p, "hidden", False)]
        problems: list[str] = []
        given: dict[str, str] = {}
        config, sets = None, []
        for i, token in enumerate(args):
            if token == "--":
                break
            flag, _, inline = token.partition("=")
            if not flag.startswith("--"):
                continue
            param = by_flag.get(flag)
            if param is None:
                near = difflib.get_close_matches(flag, valid, n=1, cutoff=0.7)
                problems.append(f"no such option: {flag}" + (f" (did you mean {near[0]}?)" if near else ""))
            elif flag in MEGATRON_REFUSED:
                problems.append(_refused(flag))
            else:
                given.setdefault(param.name, flag)
                value = inline or (args[i + 1] if i + 1 < len(args) else None)
                if param.name == "config":
                    config = value
                elif param.name == "overrides" and value is not None:
                    sets.append(value)
        problems += [f"{given[a]} and {given[b]} cannot be given together" for a, b in TRAIN_CONFLICTS
                     if a in given and b in given]
        if problems:
            problems += _config_key_problems(config, sets)
        return problems


def _config_key_problems(config: str | None, sets: list[str]) -> list[str]:
    """The misspelled-key message of ``--config`` and ``--set`` (empty otherwise: other failures come later)."""
    from tokenloom.train.config import load_config  # lazy: start-up time (torch); on the error path only

    try:
        load_config(config if config and os.path.isfile(config) else None, sets)
    except Exception as exc:  # noqa: BLE001 - only the unknown-key message is wanted here
        return [str(exc)] if str(exc).startswith("unknown config key") else []
    return []


@main.command(cls=_TrainCommand, epilog="Megatron (pretrain_gpt.py) and torchrun spellings are accepted where the meaning is the "
              "same (second names above); Megatron flags that mean something else here are refused one by one "
              "with what to use instead.")
@click.option("--config", type=click.Path(exists=True, dir_okay=False),
              help="Train config (YAML or JSON); the flags below and --set override it.")
@click.option("--set", "overrides", multiple=True, help="Override any config field: --set optim.lr=3e-4 (repeatable).")
@click.option("--data", "--data-path", "data", cls=_Greedy, multiple=True,
              help="Train on a blend of WEIGHT PREFIX pairs (or prefixes alone for equal weights).")
@click.option("--blend-file", type=click.Path(exists=True, dir_okay=False),
              help="YAML/JSON blend, as build takes it: {data: [[w, prefix], ...]} (an entry may be {weight, prefix, "
                   "name}: the name of its losses per source); split by --split. Beside data, schedule: [{start_iter: "
                   "N, blend: [[w, source], ...]}, ...] switches the train blend at those iterations (data.schedule).")
@click.option("--mock-data", is_flag=True, help="Train on synthetic data (no files needed).")
@click.option("--tokenizer", "--tokenizer-model", "tokenizer",
              help="Tokenizer path (or 'byte'): checked against the data's manifests, stored for generate; sizes "
              "model.vocab_size.")
@click.option("--tokenizer-type", help="Megatron's tokenizer class (HuggingFaceTokenizer, GPT2BPETokenizer, "
              "SentencePieceTokenizer, TikTokenizer, NullTokenizer, ...): checked against the kind detected from the "
              "files of --tokenizer-model (or --vocab-file/--merge-file), which decide the backend.")
@click.option("--vocab-file", help="GPT-2 vocab file (Megatron); with --merge-file in the same folder it is "
              "--tokenizer FOLDER.")
@click.option("--merge-file", help="GPT-2 merges file (Megatron); see --vocab-file.")
@click.option("--split", help="Train/valid/test split of the blend's sources, e.g. 969,30,1.")
@click.option("--cache-dir", "--data-cache-path", "cache_dir",
              help="Directory for the blend's index arrays (built once, shared by ranks).")
@click.option("--seq-length", type=int, help="Tokens per sample (model.seq_len).")
@click.option("--num-layers", type=int, help=_help(_MODEL, "n_layers"))
@click.option("--hidden-size", type=int, help=_help(_MODEL, "d_model"))
@click.option("--num-attention-heads", type=int, help=_help(_MODEL, "n_heads"))
@click.option("--num-query-groups", type=int, help=_help(_MODEL, "n_kv_heads"))
@click.option("--ffn-hidden-size", type=int, help=_help(_MODEL, "ffn_hidden_size"))
@click.option("--make-vocab-size-divisible-by", type=int, help=_help(_MODEL, "make_vocab_size_divisible_by"))
@click.option("--group-query-attention", is_flag=True, help="Megatron's switch for --num-query-groups (needs it).")
@click.option("--normalization", "norm", type=click.Choice(["LayerNorm", "RMSNorm"]), help=_help(_MODEL, "norm"))
@click.option("--swiglu", "mlp", flag_value="swiglu", default=None,
              help="SwiGLU MLP (model.mlp=swiglu); without --ffn-hidden-size, Megatron's width int(4h x 2/3 / 64) x 64.")
@click.option("--position-embedding-type", "positions", type=click.Choice(["learned_absolute", "rope"]),
              help=_help(_MODEL, "positions"))
@click.option("--rotary-base", type=float, help=_help(_MODEL, "rope_theta"))
@click.option("--untie-embeddings-and-output-weights", "tie_embeddings", flag_value=False, default=None,
              help="A separate LM-head matrix (model.tie_embeddings=false).")
@click.option("--disable-bias-linear", "bias", flag_value=False, default=None,
              help="No biases in linear layers (model.bias=false); LayerNorm keeps its bias (model.norm_bias=true).")
@click.option("--attention-dropout", type=float, help="Sets model.dropout (with --hidden-dropout: equal values).")
@click.option("--hidden-dropout", type=float, help="Sets model.dropout (with --attention-dropout: equal values).")
@click.option("--init-method-std", type=float, help=_help(_MODEL, "init_std"))
@click.option("--num-experts", type=int, help=_help(_MODEL, "num_experts"))
@click.option("--moe-router-topk", type=int, help=_help(_MODEL, "moe_router_topk"))
@click.option("--moe-ffn-hidden-size", type=int, help=_help(_MODEL, "moe_ffn_hidden_size"))
@click.option("--moe-layer-freq", type=int, help=_help(_MODEL, "moe_layer_freq"))
@click.option("--moe-router-load-balancing-type", type=click.Choice(["aux_loss", "seq_aux_loss", "none"]),
              help=_help(_MODEL, "moe_router_load_balancing_type"))
@click.option("--moe-aux-loss-coeff", type=float, help=_help(_MODEL, "moe_aux_loss_coeff"))
@click.option("--moe-z-loss-coeff", type=float, help=_help(_MODEL, "moe_z_loss_coeff"))
@click.option("--moe-grouped-gemm", is_flag=True, default=None, help=_help(_MODEL, "moe_grouped_gemm"))
@click.option("--max-position-embeddings", type=int,
              help="Accepted when >= the sequence length (the model's positions cover model.seq_len).")
@click.option("--train-iters", type=int, help=_help(_TRAIN, "train_iters"))
@click.option("--micro-batch-size", type=int, help=_help(_TRAIN, "micro_batch_size"))
@click.option("--global-batch-size", type=int, help=_help(_TRAIN, "global_batch_size"))
@click.option("--lr", type=float, help=_help(_OPTIM, "lr"))
@click.option("--min-lr", type=float, help=_help(_OPTIM, "min_lr"))
@click.option("--lr-warmup-iters", type=int, help=_help(_OPTIM, "warmup_iters"))
@click.option("--lr-decay-iters", type=int, help=_help(_OPTIM, "lr_decay_iters"))
@click.option("--weight-decay", type=float, help=_help(_OPTIM, "weight_decay"))
@click.option("--optimizer", type=click.Choice(["adamw", "muon"]), help=_help(_OPTIM, "name"))
@click.option("--muon-momentum", type=float, help=_help(_OPTIM, "muon_momentum"))
@click.option("--muon-num-ns-steps", type=int, help=_help(_OPTIM, "muon_ns_steps"))
@click.option("--muon-tp-mode", type=click.Choice(["duplicated", "blockwise"]), help=_help(_OPTIM, "muon_tp_mode"))
@click.option("--force-optimizer", "force_optimizer", is_flag=True, default=None, help=_help(_TRAIN, "force_optimizer"))
@click.option("--clip-grad", type=float, help=_help(_OPTIM, "grad_clip"))
@click.option("--adam-beta1", type=float, help=_help(_OPTIM, "beta1"))
@click.option("--adam-beta2", type=float, help=_help(_OPTIM, "beta2"))
@click.option("--adam-eps", type=float, help=_help(_OPTIM, "eps"))
@click.option("--lr-decay-style", type=click.Choice(["constant", "linear", "cosine", "WSD", "inverse-square-root"]),
              help=_help(_OPTIM, "decay_style"))
@click.option("--lr-wsd-decay-iters", type=int, help=_help(_OPTIM, "wsd_decay_iters"))
@click.option("--lr-wsd-decay-style", type=click.Choice(["exponential", "linear", "cosine", "minus_sqrt"]),
              help=_help(_OPTIM, "wsd_decay_style"))
@click.option("--tensorboard-dir", help=_help(_TRAIN, "tensorboard_dir"))
@click.option("--exit-signal-handler", "save_on_signal", flag_value=True, default=None,
              help="Save and stop on SIGTERM/SIGINT (save_on_signal, already the default).")
@click.option("--seed", type=int, help=_help(_TRAIN, "seed"))
@click.option("--eval-interval", type=int, help=_help(_TRAIN, "eval_interval"))
@click.option("--eval-iters", type=int, help=_help(_TRAIN, "eval_iters"))
@click.option("--log-interval", type=int, help=_help(_TRAIN, "log_interval"))
@click.option("--save-interval", type=int, help=_help(_TRAIN, "save_interval"))
@click.option("--local-save-interval", type=int, help=_help(_TRAIN, "local_save_interval"))
@click.option("--local-save-dir", help=_help(_TRAIN, "local_save_dir"))
@click.option("--hang-timeout", "hang_timeout", type=float, help=_help(_TRAIN, "hang_timeout_s"))
@click.option("--bf16", "precision", flag_value="bf16", default=None, help="bf16 autocast (precision=bf16).")
@click.option("--output-dir", help=_help(_TRAIN, "output_dir"))
@click.option("--resume", help=_help(_TRAIN, "resume"))
@click.option("--init-from-hf", "init_from_hf", help=_help(_TRAIN, "init_from_hf"))
@click.option("--wandb-project", help=_help(_TRAIN, "wandb_project"))
@click.option("--wandb-exp-name", help=_help(_TRAIN, "wandb_exp_name"))
@click.option("--override-opt_param-scheduler", "--override-opt-param-scheduler", "override_opt_param_scheduler",
              is_flag=True, default=None, help=_help(_TRAIN, "override_opt_param_scheduler"))
@click.option("--fp8", type=click.Choice(["tensorwise", "rowwise"]), is_flag=False, flag_value="tensorwise",
              default=None, help=_help(_TRAIN, "fp8") + " --fp8 alone: tensorwise.")
@click.option("--kernels", type=click.Choice(["auto", "reference", "compiled", "triton"]),
              help=_help(_MODEL, "kernels"))
@click.option("--tp", "--tensor-model-parallel-size", "tp", type=int,
              help="Tensor-parallel size (Megatron's layout: tp fastest, then cp, dp, pp).")
@click.option("--cp", "--context-parallel-size", "cp", type=int, help=_help(_TRAIN, "cp"))
@click.option("--ep", "--expert-model-parallel-size", "ep", type=int, help=_help(_TRAIN, "ep"))
@click.option("--moe-token-dispatcher-type", "moe_token_dispatcher_type", type=click.Choice(["alltoall", "allgather"]),
              help=_help(_MODEL, "moe_token_dispatcher_type"))
@click.option("--pp", "--pipeline-model-parallel-size", "pp", type=int, help="Pipeline-parallel size (1F1B schedule).")
@click.option("--vpp", "--virtual-pipeline-model-parallel-size", "vpp", type=int,
              help="Virtual pipeline stages (model chunks) per pipeline rank (interleaved 1F1B).")
@click.option("--num-layers-per-virtual-pipeline-stage", "layers_per_virtual_stage", type=int,
              help="Megatron's other way to set --vpp: vpp = num layers / (pp x this).")
@click.option("--decoder-first-pipeline-num-layers", "num_layers_in_first_pipeline_stage", type=int,
              help=_help(_TRAIN, "num_layers_in_first_pipeline_stage"))
@click.option("--decoder-last-pipeline-num-layers", "num_layers_in_last_pipeline_stage", type=int,
              help=_help(_TRAIN, "num_layers_in_last_pipeline_stage"))
@click.option("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split", is_flag=True,
              default=None, help=_help(_TRAIN, "account_for_embedding_in_pipeline_split"))
@click.option("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split", is_flag=True,
              default=None, help=_help(_TRAIN, "account_for_loss_in_pipeline_split"))
@click.option("--sp/--no-sp", "--sequence-parallel", "sp", default=None,
              help=_pair(_help(_TRAIN, "sp"), False, "--no-sp", "plain tensor parallelism"))
@click.option("--zero1", "--use-distributed-optimizer", "zero1", is_flag=True, default=None,
              help="Shard the optimizer state over data-parallel ranks (ZeRO-1; Megatron's distributed optimizer).")
@click.option("--fsdp", "--use-megatron-fsdp", "fsdp", is_flag=True, default=None,
              help="Shard parameters, gradients and optimizer state over data-parallel ranks (ZeRO-3, torch's "
              "fully_shard; Megatron's --use-megatron-fsdp maps here).")
@click.option("--overlap-param-gather", "overlap_param_gather", is_flag=True, default=None,
              help="ZeRO-1: all-gather the updated parameters during the next forward (Megatron's flag; already "
              "the default with --zero1; --set overlap_param_gather=false gathers them in the step).")
@click.option("--distributed-backend", "distributed_backend", type=click.Choice(["nccl", "gloo"]),
              help=_help(_TRAIN, "distributed_backend"))
@click.option("--nproc-per-node", "--nproc_per_node", "nproc_per_node", type=int,
              help="Start torchrun with N processes on this node; without it, run in-process (e.g. under "
              "torchrun/Slurm).")
@click.option("--nnodes", default="1", show_default=True, metavar="N|MIN:MAX", help=_help(_NODES, "nnodes"))
@click.option("--node-rank", "--node_rank", "node_rank", type=int, default=0, show_default=True,
              help=_help(_NODES, "node_rank"))
@click.option("--master-addr", "--master_addr", "master_addr", help=_help(_NODES, "master_addr"))
@click.option("--master-port", "--master_port", "master_port", type=int, help=_help(_NODES, "master_port"))
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", help=_help(_NODES, "rdzv_endpoint"))
@click.option("--rdzv-id", "--rdzv_id", "rdzv_id", help=_help(_NODES, "rdzv_id"))
@click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", help=_help(_NODES, "rdzv_conf"))
@click.option("--max-restarts", "--max_restarts", "max_restarts", type=int, default=0, show_default=True,
              help="With --nproc-per-node: torchrun restarts the ranks this many times after a failure (a kill, an "
              "error, a collective timeout, a hang); they resume from the newest complete checkpoint, each restart "
              "is recorded in metrics.jsonl and the summary, and a failure a restart would repeat stops the job; "
              "with --nnodes MIN:MAX a lost node costs one restart of the nodes left (docs/faults.md).")
@click.option("--verbose", is_flag=True, help="With --nproc-per-node: stream every rank's and torchrun's output "
              "unchanged instead of rank 0's on the terminal and the rest in OUTPUT_DIR/logs/.")
@_megatron_refused
def train(config, overrides, nproc_per_node, nnodes, node_rank, master_addr, master_port, rdzv_endpoint, rdzv_id,
          rdzv_conf, max_restarts, verbose, vocab_file, merge_file, tokenizer_type, layers_per_virtual_stage,
          max_position_embeddings, **flags):
    """Train a GPT (DDP over every rank of the launch) on a blend or mock data; rank 0 prints
    the run's summary (JSON: iteration, losses, checkpoint, tokens/s, first step, saves) last.

    The config is checked before any rank starts (layout, batch arithmetic, data, tokenizer, resume). Without
    a model shape (flags, --config or --set), a small model trains, and a warning says so."""
    from tokenloom.train.config import load_config, small_model_overrides  # lazy: start-up time
    from tokenloom.train.launch import (  # lazy: start-up time
        Nodes,
        check_max_position_embeddings,
        flag_overrides,
        launch,
        megatron_swiglu_width,
        parse_nnodes,
        stdout_outlives_its_reader,
    )

    stdout_outlives_its_reader()

    if vocab_file or merge_file:
        flags["tokenizer"] = _megatron_tokenizer(vocab_file, merge_file, flags["tokenizer"])
    if tokenizer_type is not None:
        from tokenloom.tokenizers.load import check_megatron_type  # lazy: start-up time

        check_megatron_type(flags["tokenizer"], tokenizer_type)
    given = [*flag_overrides(**flags), *overrides]
    small = small_model_overrides(config, given)
    if small:
        click.echo(f"warning: no model shape given: training a small model ({', '.join(small)}); give --num-layers, "
                   "--hidden-size, --num-attention-heads and --seq-length (or model.* in --config) for another",
                   err=True)
    cfg = megatron_swiglu_width(load_config(config, [*small, *given]), flags.get("mlp") == "swiglu")
    check_max_position_embeddings(cfg, max_position_embeddings)
    if layers_per_virtual_stage:
        if not cfg.pipeline_split.is_even:
            raise click.UsageError("--num-layers-per-virtual-pipeline-stage assumes an even split; with an uneven one "
                                   "give the chunks per pipeline rank as --vpp")
        stages = cfg.pp * layers_per_virtual_stage
        if cfg.model.n_layers % stages or cfg.model.n_layers == stages:
            raise click.UsageError(f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}: "
                                   f"{cfg.model.n_layers} layers must be a multiple (> 1) of --pp {cfg.pp} x "
                                   f"{layers_per_virtual_stage}")
        cfg = dataclasses.replace(cfg, vpp=cfg.model.n_layers // stages)
    min_nodes, max_nodes = parse_nnodes(nnodes)
    nodes = Nodes(nnodes=max_nodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                  rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, rdzv_conf=rdzv_conf, min_nodes=min_nodes)
    if nodes.elastic and verbose:
        raise click.UsageError(f"--verbose with --nnodes {nnodes}: an elastic job's ranks run through the launcher's "
                               "log directory (OUTPUT_DIR/logs/); leave out --verbose")
    if nproc_per_node is None and max_restarts:
        raise click.UsageError("--max-restarts needs --nproc-per-node (torchrun restarts the ranks it started)")
    if nproc_per_node is None and nodes != Nodes():
        raise click.UsageError("--nnodes/--node-rank/--master-addr/--master-port/--rdzv-endpoint/--rdzv-id/--rdzv-conf need "
                               "--nproc-per-node (this command then starts torchrun on this node)")
    echo = functools.partial(click.echo, err=True)
    try:
        summary = launch(cfg, nproc_per_node, nodes=nodes, verbose=verbose, echo=echo, max_restarts=max_restarts)
    except KeyboardInterrupt:  # Ctrl-C before the steps (they save and stop instead)
        from tokenloom.train.checkpoint.commit import resume_advice  # lazy: start-up time (the train stack)

        raise Stopped(f"interrupted (SIGINT) before training; {resume_advice(cfg.ckpt_dir)}", signal.SIGINT) from None
    if nproc_per_node is None and int(os.environ.get("RANK", "0")) == 0:  # torchrun's rank 0 printed its own
        click.echo(json.dumps(summary))
    if summary is not None and summary.get("stopped_by"):  # saved and stopped on a signal: the shell's status
        sys.exit(128 + signal.Signals[summary["stopped_by"]])


def _megatron_tokenizer(vocab_file: str | None, merge_file: str | None, tokenizer: str | None) -> str:
    """Megatron's --vocab-file/--merge-file pair as a --tokenizer folder."""
    if tokenizer:
        raise click.UsageError("give the tokenizer either as --tokenizer or as --vocab-file/--merge-file")
    if not (vocab_file and merge_file) or Path(vocab_file).resolve().parent != Path(merge_file).resolve().parent:
        raise click.UsageError("--vocab-file and --merge-file go together and must be in one folder (it is "
                               "passed as --tokenizer FOLDER); or pass --tokenizer PATH")
    return str(Path(vocab_file).parent)


@main.group("config")
def config_group():
    """Inspect train configs."""


@config_group.command("show")
@click.option("--config", type=click.Path(exists=True, dir_okay=False), help="Train config (YAML or JSON) to show; "
              "without it, the defaults.")
@click.option("--set", "overrides", multiple=True, help="Override any config field: --set optim.lr=3e-4 (repeatable).")
def config_show(config, overrides):
    """Every train config field (sections too) with its value, its default and its doc; '*' marks a
    value that differs from its default."""
    from tokenloom.train.config import field_rows, format_rows, load_config  # lazy: start-up time (torch)

    click.echo(format_rows(field_rows(load_config(config, overrides))))


_EXPORT = "tokenloom.train.checkpoint.hf:ExportConfig"


@main.command()
@click.option("--checkpoint", required=True, help=_help(_EXPORT, "checkpoint"))
@click.option("--output", required=True, help=_help(_EXPORT, "output"))
@click.option("--tokenizer", help=_help(_EXPORT, "tokenizer"))
def export(**options):
    """Write a checkpoint (any layout) as a Hugging Face transformers folder (GPT2LMHeadModel or
    LlamaForCausalLM in model.safetensors, with the tokenizer for AutoTokenizer); prints its path."""
    from tokenloom.train.checkpoint.hf import ExportConfig  # lazy: start-up time
    from tokenloom.train.checkpoint.hf import export as run  # lazy: start-up time

    click.echo(run(ExportConfig(**options)))


@main.command()
@click.option("--checkpoint", required=True, help="Checkpoint directory, or a run's checkpoint root (latest).")
@click.option("--prompt", default="", help="Text to continue.")
@click.option("--max-new-tokens", type=int, default=100, show_default=True, help="Tokens to sample.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=50, show_default=True, help="Sample among the k most likely tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same text.")
@click.option("--tokenizer", help="Tokenizer path (or 'byte') to decode with; default: the one the run stored.")
def generate(**options):
    """Sample text from a checkpoint with its own tokenizer."""
    from tokenloom.train.generate import GenerateConfig  # lazy: start-up time
    from tokenloom.train.generate import generate as run  # lazy: start-up time

    click.echo(run(GenerateConfig(**options)))


@main.group()
def tokenizer():
    """Train and inspect tokenizers."""


def _tt_help(name: str) -> str:
    return _help("tokenloom.tokenizers.train:TrainTokenizerConfig", name)


@tokenizer.command("train")
@click.option("--input", "inputs", cls=_Greedy, multiple=True, required=True, help=_tt_help("inputs"))
@click.option("--output", required=True, help=_tt_help("output"))
@click.option("--kind", type=click.Choice(["bpe", "unigram"]), default="bpe", show_default=True, help=_tt_help("kind"))
@click.option("--vocab-size", type=int, default=32000, show_default=True, help=_tt_help("vocab_size"))
@click.option("--special-token", "special_tokens", multiple=True, help=_tt_help("special_tokens"))
@click.option("--min-frequency", type=int, default=2, show_default=True, help=_tt_help("min_frequency"))
@click.option("--json-keys", "--json-key", "json_key", default="text", show_default=True, help=_tt_help("json_key"))
@click.option("--seed", type=int, default=0, show_default=True, help=_tt_help("seed"))
def tokenizer_train(**options):
    """Train a byte-level BPE (tokenizers) or unigram (sentencepiece) tokenizer; it loads in preprocess."""
    from tokenloom.tokenizers import (  # lazy: start-up time
        TrainTokenizerConfig,
        train_tokenizer,
    )
    from tokenloom.tokenizers.train import vocabulary_shortfall  # lazy: start-up time

    options["inputs"] = list(options["inputs"])
    if options["special_tokens"]:
        options["special_tokens"] = list(options["special_tokens"])
    else:
        del options["special_tokens"]
    cfg = TrainTokenizerConfig(**options)
    out = train_tokenizer(cfg)
    shortfall = vocabulary_shortfall(cfg, out)
    if shortfall:
        click.echo(f"warning: {shortfall}", err=True)
    click.echo(f"wrote {out}")


@tokenizer.command("inspect")
@click.argument("path", required=False)
@click.option("--tokenizer-type", help="Force the tokenizer kind instead of detecting it.")
def tokenizer_inspect(path, tokenizer_type):
    """Kind, vocabulary size, special ids and fingerprint of a tokenizer."""
    from tokenloom.tokenizers import load_tokenizer  # lazy: start-up time

    click.echo(json.dumps(load_tokenizer(path, kind=tokenizer_type).fingerprint(), indent=2))


def _demo_help(name: str) -> str:
    return _help("tokenloom.demo:DemoConfig", name)


@main.command()
@click.option("--output-dir", default="demo-out", show_default=True, help=_demo_help("output_dir"))
@click.option("--max-documents", default=600, show_default=True, help=_demo_help("max_documents"))
@click.option("--vocab-size", default=4096, show_default=True, help=_demo_help("vocab_size"))
@click.option("--train-iters", default=400, show_default=True, help=_demo_help("train_iters"))
@click.option("--nproc-per-node", "--nproc_per_node", "--nproc", "nproc", default=2, show_default=True,
              help=_demo_help("nproc"))
def demo(**options):
    """The embedded default job, no download: tokenizer -> preprocess -> blend -> 2-rank training -> sample."""
    from tokenloom.demo import DemoConfig, run  # lazy: start-up time

    run(DemoConfig(**options), echo=click.echo)


EXAMPLES: dict[str, tuple[str, ...]] = {
    "info": ("tokenloom info",),
    "inspect": ("tokenloom inspect data/corpus_text_document", "tokenloom inspect data/corpus_text_document --json"),
    "verify": ("tokenloom verify data/corpus_text_document --vocab-size 50257",),
    "merge": ("tokenloom merge --output-prefix data/all data/part0 data/part1",),
    "preprocess": ("tokenloom preprocess --input corpus.jsonl.zst --output-prefix data/corpus --tokenizer tok/gpt2 "
                   "--append-eod",
                   "tokenloom preprocess --input 's3://bucket/raw/*.parquet' --output-prefix data/web --tokenizer "
                   "tok/llama3 --workers 8"),
    "build": ("tokenloom build --data 0.7 data/web 0.3 data/code --seq-length 1024 --num-samples 100000",
              "tokenloom build --blend-file blend.yaml --seq-length 2048 --num-samples 1000000,10000,0 --plot plan.png"),
    "train": ("tokenloom train --mock-data --train-iters 20",
              "tokenloom train --data data/corpus --tokenizer tok/gpt2 --num-layers 12 --hidden-size 768 "
              "--num-attention-heads 12 --seq-length 1024 --nproc-per-node 8 --tensor-model-parallel-size 2"),
    "config": ("tokenloom config show",),
    "config show": ("tokenloom config show --set optim.lr=3e-4", "tokenloom config show --config run.yaml"),
    "export": ("tokenloom export --checkpoint out/checkpoints --output hf-model",),
    "generate": ("tokenloom generate --checkpoint out/checkpoints --prompt 'Once upon a time' --max-new-tokens 50",),
    "tokenizer": ("tokenloom tokenizer inspect tok/gpt2",),
    "tokenizer train": ("tokenloom tokenizer train --input corpus.jsonl --output tok/mine --vocab-size 32000",),
    "tokenizer inspect": ("tokenloom tokenizer inspect tok/llama3/tokenizer.model",),
    "demo": ("tokenloom demo", "tokenloom demo --nproc-per-node 1 --train-iters 50"),
}
"""One or two lines a user can paste, shown at the end of each command's ``--help`` (and checked by
``tests/cli/test_help.py``: every command has them and every flag they name exists)."""


def _add_examples(group: click.Group, prefix: str = "") -> None:
    for name, command in group.commands.items():
        full = f"{prefix}{name}"
        lines = "\n".join(f"  {line}" for line in EXAMPLES[full])
        command.epilog = (f"{command.epilog}\n\n" if command.epilog else "") + f"\b\nExamples:\n{lines}"
        if isinstance(command, click.Group):
            _add_examples(command, f"{full} ")


_add_examples(main)


if __name__ == "__main__":
    main()
