"""``python -m tinypaged.course``: the instructor's command line (see tinypaged.course.coursework)."""

import sys

from tinypaged.course.coursework import main

if __name__ == "__main__":  # a module walk (the reuse scan) imports this file too
    sys.exit(main())
