"""``python -m ravnest_swarm`` and the ``ravnest-swarm`` command's entry point."""

import sys


def main() -> None:
    """The CLI, loaded here: its imports (torch, hivemind) take seconds, and a Ctrl-C during them ended the command
    with a traceback and no exit status of ours; now with 130, as a Ctrl-C anywhere later."""
    try:
        from ravnest_swarm.cli import main as cli_main
    except KeyboardInterrupt:
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()
