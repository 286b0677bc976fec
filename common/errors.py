"""One way to stop: a clear line on stderr and a non-zero exit, never a traceback for a problem the user can fix."""
import sys


class FatalError(Exception):
    """A problem the user can fix (missing data, bad path, damaged file); its message names the cause and the fix."""


def run_main(main):
    """Run an entry script's main(); turn FatalError into one line and exit 1, Ctrl-C into exit 130."""
    try:
        main()
    except FatalError as e:
        print("error:", " ".join(str(e).split()), file=sys.stderr, flush=True)  # always one line
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
