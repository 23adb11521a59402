"""``kvproxy doctor``: is a live deployment set up for kvproxy's features?

:mod:`kvproxy.doctor.checks` turns what was read (facts) into report lines, pure;
:mod:`kvproxy.doctor.gather` reads the router and the engines; :mod:`kvproxy.doctor.cli`
is the subcommand.
"""
