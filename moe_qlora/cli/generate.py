"""`moe-qlora generate`: a prompt through the 4-bit model and a run's adapter, rendered as the run rendered its rows
(inference.generate.Rendering); the completion streams to stdout, what the model was given to stderr."""

from __future__ import annotations

import typer

from moe_qlora.cli.common import err_console, fail, quiet_libraries, user_errors

GENERATE_EPILOG = """Examples:

  moe-qlora generate --adapter runs/demo/adapter "Add: 3+5"

  moe-qlora generate --adapter runs/demo/adapter --no-adapter "Add: 3+5"     # the base model, to compare

  moe-qlora generate --adapter runs/demo/adapter --chat "First letter of apple?"   # the chat template

  moe-qlora generate --adapter runs/demo/adapter --raw "Add: 3+5"     # exactly these characters, no newline added
"""


def generate_cmd(
    prompt: str = typer.Argument(..., help="the prompt (with --chat: the user message)"),
    adapter: str = typer.Option(..., "--adapter", "-a", help="the adapter folder a run wrote"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0: greedy"),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0, help="0: off"),
    seed: int = typer.Option(0, "--seed"),
    chat: bool = typer.Option(
        False, "--chat", help="a user turn through the tokenizer's chat template (default: as the run trained)"
    ),
    raw: bool = typer.Option(False, "--raw", help="the prompt exactly as given (default: as the run trained)"),
    no_adapter: bool = typer.Option(False, "--no-adapter", help="generate with the base model (adapters off)"),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
):
    """Generate with the 4-bit model and a run's adapter (as trained), streaming the tokens. The prompt is rendered
    as the run's data was: its prompt rows' format (the demo's end in a newline), or the chat template when it
    trained on messages; --chat or --raw choose. The rendering used is printed to stderr."""
    quiet_libraries()
    from moe_qlora.inference.generate import Sampling, generate, load_for_generation, rendering_for

    try:
        rendering = rendering_for(adapter, chat=chat, raw=raw)
        model, tokenizer = load_for_generation(adapter, err_console, device=device)
        rendering.ids(tokenizer, prompt)  # a prompt it cannot render (no chat template) fails here, in one sentence
    except user_errors() as exc:
        fail(exc, debug)
    err_console.print(rendering.describe(prompt), highlight=False, soft_wrap=True)
    sampling = Sampling(max_new_tokens, temperature, top_p, top_k, seed)
    generate(model, tokenizer, prompt, sampling, rendering=rendering, adapter=not no_adapter)  # ends the line itself
