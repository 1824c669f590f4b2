"""``python -m specmd.cli ...`` is ``specmd ...`` (:func:`specmd.cli.main`)."""

from . import main

if __name__ == "__main__":
    main()
