"""The ``cgroupd`` command line: the only package that reads argv and the environment.

Commands::

    cgroupd [global options] COMMAND
      join         run one member instance (handler function or webhook), until SIGTERM
      group        create | delete | ls | info
      member       add | drop | ls
      mapping      set | clear
      step-down    ask a member's active instance to hand over to a standby
      status       per partition: member, active instance, lag; --watch, --members
      events       follow the group's advisories
      replay       reprocess from a sequence or a time (dry run unless --execute)
      console      the groups in a browser: partitions, lag, instances, events, actions
      demo         a self-contained demo with an embedded nats-server

Exit codes: 0 success, 1 operational failure (server unreachable, group missing, any
other cgroupd error), 2 usage error (bad arguments, names, mapping syntax, a handler that
cannot be loaded). Expected errors print one line on stderr; ``--debug`` adds the
traceback. Every option has an environment variable ``CGROUPD_<OPTION>``; the servers also
come from ``NATS_URL``.

Modules: ``application`` (the app, global options, errors to exit codes), ``errors``,
``context`` (what commands share), ``options`` (shared arguments), ``parsers`` (pure),
one per command family: ``join``, ``groups``, ``members`` (member, mapping, step-down),
``observe`` (status, events), ``replay``, ``console``, ``demo``. Rendering lives in
:mod:`cgroupd.views`.
"""

from cgroupd.cli.application import app, main

__all__ = ["app", "main"]
