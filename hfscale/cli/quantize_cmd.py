"""`hfscale quantize`: PTQ to a transformers directory, or export to GGUF / ExecuTorch .pte.

Every choice comes from a registry: --scheme from compress.schemes.SCHEMES, --format and --qtype
from export.FORMATS. Everything is validated before anything is loaded or written.
"""

from __future__ import annotations

import json

EPILOG = """examples:
  hfscale quantize tiny-gemma3 --scheme 8da4w --out q_8da4w                  # transformers dir (safetensors)
  hfscale quantize runs/tiny/model --scheme int4wo --group-size 0 --out q_int4_pc
  hfscale quantize runs/tiny/model --scheme gptq-int4wo --calibration builtin --out q_gptq
  hfscale quantize runs/tiny/model --format gguf --qtype Q4_0 --out model-Q4_0.gguf   # checked in llama.cpp
  hfscale quantize runs/tiny/model --format pte --qtype 8da4w --out model.pte         # checked in executorch.runtime
  hfscale quantize runs/base --format gguf --adapter runs/lora --out lora.gguf         # peft LoRA -> llama.cpp --lora
  hfscale quantize --list
"""


def add_parser(sub):
    import argparse

    from ..compress.schemes import PTQ_SCHEMES
    from ..export import FORMATS

    p = sub.add_parser("quantize", help="post-training quantization to a transformers dir, GGUF or .pte",
                       description="Quantize a model (built-in name, local dir, hub name when online) and write an "
                       "artifact that its runtime loads: a transformers directory (torchao / bitsandbytes), a GGUF file "
                       "(llama.cpp) or an ExecuTorch .pte. Each is reloaded and checked against the source before it "
                       "is moved into place.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="built-in name (tiny-gemma3), transformers directory, or hub name")
    p.add_argument("--out", help="output directory (transformers) or file (.gguf, .pte); missing parent directories "
                   "are created; never the MODEL itself, inside it or around it")
    p.add_argument("--format", default="transformers", choices=["transformers", *FORMATS])
    p.add_argument("--scheme", choices=PTQ_SCHEMES, help="transformers format: quantization scheme (see --list)")
    p.add_argument("--group-size", type=int, default=32, help="input columns per scale; 0 = per-channel")
    p.add_argument("--mapping", choices=["symmetric", "asymmetric"], help="default: the scheme's first")
    p.add_argument("--include-embeddings", action="store_true", help="also quantize the embedding (and tied lm_head)")
    p.add_argument("--calibration", help="calibrated schemes: 'builtin' (train split of the built-in corpus) or a text file")
    p.add_argument("--calibration-blocks", type=int, default=32, help="calibration sequences of --seq-len tokens")
    p.add_argument("--seq-len", type=int, default=128, help="calibration sequence length")
    p.add_argument("--qtype", help="gguf: F16 BF16 Q8_0 Q4_0 (default Q4_0); pte: fp32 8da4w (default 8da4w)")
    p.add_argument("--embed-qtype", help="gguf: token embedding type (default Q8_0 for quantized qtypes)")
    p.add_argument("--adapter", metavar="DIR", help="gguf: write the peft LoRA adapter in DIR (trained on MODEL) as a "
                   "llama.cpp adapter GGUF (llama-cli --lora) instead of the model; checked against the merged model")
    p.add_argument("--max-seq-len", type=int, default=128, help="pte: KV-cache length compiled into the program")
    p.add_argument("--no-verify", action="store_true", help="skip the reload / runtime check (large models)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--list", action="store_true", help="print the scheme and format registries and exit")
    p.set_defaults(run=run)


def _registry_text() -> str:
    from ..compress.schemes import table
    from ..export import FORMATS

    fmts = "\n".join(f"| {f.name} | {', '.join(f.qtypes)} | {f.default_qtype} | {f.runtime} |" for f in FORMATS.values())
    return (table() + "\n\n| format | qtypes | default | verified in |\n|---|---|---|---|\n"
            + "| transformers | --scheme (above) | - | transformers from_pretrained |\n" + fmts)


def run(args) -> int:
    from ..util.errors import HfscaleError

    if args.list:
        print(_registry_text())
        return 0
    if not args.model or not args.out:
        raise HfscaleError("give MODEL and --out (e.g. hfscale quantize tiny-gemma3 --scheme 8da4w --out q_dir)")
    _require_extra(args)
    if args.adapter:
        return _run_adapter(args)
    if args.format == "transformers":
        return _run_ptq(args)
    return _run_export(args)


# what each path imports: the format's writer and runtime, or the scheme's library (GPTQ uses torchao's primitives)
FORMAT_MODULES = {"gguf": ("gguf", "llama_cpp"), "pte": ("executorch", "torchao")}
LIBRARY_MODULES = {"torchao": ("torchao",), "bitsandbytes": ("bitsandbytes",), "hfscale": ("torchao",)}


def _require_extra(args) -> None:
    from ..compress.schemes import SCHEMES
    from ..util.extras import require

    if args.format != "transformers":
        require(f"hfscale quantize --format {args.format}", "edge", FORMAT_MODULES.get(args.format))
    elif args.scheme in SCHEMES:
        require(f"hfscale quantize --scheme {args.scheme}", "quant", LIBRARY_MODULES.get(SCHEMES[args.scheme].library))


def _run_export(args) -> int:
    from ..util.errors import HfscaleError
    from ..export import FORMATS

    fmt = FORMATS[args.format]
    if args.scheme:
        raise HfscaleError(f"--scheme is for --format transformers; for {fmt.name} use --qtype ({', '.join(fmt.qtypes)})")
    qtype = args.qtype or fmt.default_qtype
    if qtype not in fmt.qtypes:
        raise HfscaleError(f"--qtype {qtype} is not offered for {fmt.name}; choose one of {', '.join(fmt.qtypes)}")
    kw = {"embed_qtype": args.embed_qtype} if fmt.name == "gguf" else {"max_seq_len": args.max_seq_len}
    if fmt.name == "pte" and args.embed_qtype:
        raise HfscaleError("--embed-qtype is a GGUF option; drop it for --format pte")
    rec = fmt.export(args.model, args.out, qtype, args.force, verify=not args.no_verify, **kw)
    v = rec.get("verification", {})
    cmp = v.get("vs_transformers") or v.get("vs_transformers_fp32") or {}
    print(f"wrote {rec['out']}: {rec['bytes']:,} bytes ({rec['bytes'] / rec['source']['fp32_bytes']:.3f} of fp32), "
          f"{fmt.name} {qtype}, sidecar {rec['out']}.json")
    if v:
        print(f"  {v.get('runtime', fmt.runtime)}: top-1 vs transformers {cmp.get('top1_agreement', float('nan')):.3f}, "
              f"max |dlogit| {cmp.get('max_abs_dlogit', float('nan')):.4f}, perplexity {v['perplexity']:.3f} "
              f"(fp32 transformers {v['perplexity_transformers_fp32']:.3f})")
    return 0


def _run_adapter(args) -> int:
    from ..util.errors import HfscaleError
    from ..export import export_gguf_adapter

    if args.format != "gguf" or args.scheme or args.qtype or args.embed_qtype:
        raise HfscaleError("--adapter writes a GGUF LoRA adapter (F32): use it with --format gguf and without "
                           "--scheme/--qtype/--embed-qtype (quantize the base model in its own run)")
    rec = export_gguf_adapter(args.model, args.adapter, args.out, args.force, verify=not args.no_verify)
    sc = rec["scheme"]
    print(f"wrote {rec['out']}: {rec['bytes']:,} bytes, LoRA r={sc['rank']} scale {sc['scale']:g} on "
          f"{', '.join(sc['target_modules'])} ({sc['tensors']} tensors), sidecar {rec['out']}.json")
    v = rec.get("verification")
    if v:
        m, b = v["vs_merged_transformers"], v["base_alone_vs_transformers"]
        print(f"  llama.cpp, F16 base + adapter vs transformers' merged model: max |dlogit| {m['max_abs_dlogit']:.4f}, "
              f"top-1 {m['top1_agreement']:.3f} (base alone: {b['max_abs_dlogit']:.4f}; the adapter moves logits by "
              f"up to {v['adapter_effect_max_abs_dlogit']:.3f})")
    return 0


def _calibration(args, model_name: str):
    from pathlib import Path

    from ..util.errors import HfscaleError
    from ..models.builtin import load_tokenizer

    from ..compress.evaluate import calibration_blocks

    if not args.calibration:
        return None
    if args.calibration != "builtin" and not Path(args.calibration).is_file():
        raise HfscaleError(f"calibration file {args.calibration} not found; pass 'builtin' or an existing text/jsonl/parquet file")
    return calibration_blocks(load_tokenizer(model_name), args.calibration_blocks, args.seq_len, data=args.calibration)


def _run_ptq(args) -> int:
    from ..util.atomic import check_writable
    from ..compress.ptq import source_dir
    from ..compress.schemes import SCHEMES, QuantSpec, require_device
    from ..util.errors import HfscaleError
    from ..models.builtin import has_tokenizer, load_config, load_tokenizer

    if not args.scheme:
        raise HfscaleError(f"--scheme is required for --format transformers; choose one of {', '.join(s for s in SCHEMES if s != 'q4_0')}")
    if args.qtype or args.embed_qtype:
        raise HfscaleError("--qtype/--embed-qtype are for --format gguf or pte; use --scheme for a transformers directory")
    spec = QuantSpec(args.scheme, group_size=args.group_size, mapping=args.mapping, include_embeddings=args.include_embeddings)
    require_device(spec.scheme)
    check_writable({args.out: "--out"}, args.force, inputs={args.model: "MODEL", args.calibration: "--calibration"})
    load_config(args.model)  # unknown model: one line before any work
    if spec.info.calibrated and not args.calibration:
        raise HfscaleError(f"{spec.scheme} needs calibration data; pass --calibration builtin or a text file")
    calib = _calibration(args, args.model)
    with source_dir(args.model) as src:
        record = quantize_and_save(src, spec, args.out, args.force, calib, verify=not args.no_verify,
                                   tokenizer=load_tokenizer(args.model) if has_tokenizer(args.model) else None,
                                   source_name=args.model)  # weight-only PTQ needs no tokenizer; kept when present
    b0, b1 = record["source_bytes"], record["bytes"]
    grid = (f"group {spec.group_size or 'per-channel'}, {spec.resolved_mapping()}" if spec.info.library != "bitsandbytes"
            else spec.info.granularities[0])
    print(f"wrote {args.out}: {b0:,} -> {b1:,} bytes of weights ({b1 / b0:.3f}x), scheme {spec.scheme}, {grid}")
    if "reload_max_abs_dlogit" in record:
        same = "bit-identical" if record["reload_tensors_differing"] == 0 else f"{record['reload_tensors_differing']} differ"
        print(f"  reloaded with from_pretrained: tensors {same} to the in-memory model's, "
              f"max |dlogit| vs the in-memory model {record['reload_max_abs_dlogit']:.2e}")
    return 0


def quantize_and_save(src: str, spec, out, force: bool, calibration, verify: bool, tokenizer, source_name: str) -> dict:
    """Quantize, save atomically (before any forward: see scale.adapters.keep_bnb_layout_), then reload and compare."""
    import torch

    from ..compress.ptq import quantize_model, quantized_bytes_in_memory
    from ..compress.save import differing_tensors, dir_bytes, save_model_dir

    model = quantize_model(src, spec, calibration=calibration)
    record = {"source": source_name, "scheme": spec.scheme, "group_size": spec.group_size,
              "mapping": spec.resolved_mapping(), "include_embeddings": spec.include_embeddings,
              "library": spec.info.library, "source_bytes": dir_bytes(src),
              "bytes_in_memory": quantized_bytes_in_memory(model)}
    save_model_dir(model, out, tokenizer=tokenizer, force=force,
                   extra_files={"hfscale_quantization.json": json.dumps(record, indent=1) + "\n"})
    record["bytes"] = dir_bytes(out)
    if verify:
        from transformers import AutoModelForCausalLM

        ids = torch.arange(64).remainder(model.config.vocab_size - 3).add(3).unsqueeze(0)
        reloaded = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
        record["reload_tensors_differing"] = differing_tensors(model, reloaded)
        if record["reload_tensors_differing"]:  # never leave a directory that is not the model it claims to be
            import shutil

            from ..util.errors import HfscaleError

            shutil.rmtree(out, ignore_errors=True)
            raise HfscaleError(f"{out} did not reload to the quantized model ({record['reload_tensors_differing']} "
                               f"tensors differ), so it was removed: a save bug for scheme {spec.scheme}; pass "
                               "--no-verify to keep it anyway, or report it")
        with torch.no_grad():
            live = model(input_ids=ids).logits.float()
            back = reloaded(input_ids=ids).logits.float()
        record["reload_max_abs_dlogit"] = float((live - back).abs().max())
    return record
