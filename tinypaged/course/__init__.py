"""The classroom: checks, grading, the assignment pipeline and lesson helpers.

It imports the engine (``tinypaged``) and the lab (``tinypaged.lab``); neither of them imports it
(``tests/test_layout.py`` holds that). ``python -m tinypaged.course`` is the instructor's command line
(``lint``, ``generate``, ``check``, ``grade``; see docs/INSTRUCTORS.md).
"""
