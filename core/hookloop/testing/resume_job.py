"""``hookloop run ... resume_job.py OUT SPEC.json``: the job of
:class:`~hookloop.testing.ResumeConformance` (see :mod:`hookloop.testing.resume`)."""

import sys

if __name__ == "__main__":  # a spawning strategy re-imports this file in its processes
    import faulthandler

    faulthandler.enable()
    from hookloop.testing.resume import main

    main(sys.argv[1], sys.argv[2])
