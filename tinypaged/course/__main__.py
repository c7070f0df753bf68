import sys

from tinypaged.course.coursework import main

sys.exit(main())
