"""sphinx-build with the network refused: ``python docs/site/build.py SPHINX-ARGS...`` (scripts/site.sh runs it).

The site must build offline. A theme, extension or output that tried to download something (a template, a font,
an inventory) fails the build here with an error that says so, instead of quietly depending on the network.
"""

import socket
import sys

MESSAGE = "the course's site is built offline (scripts/site.sh), but something tried to reach the network: {}"


def refuse_network():
    def refuse(*args, **kwargs):
        raise OSError(MESSAGE.format(args[1:] or args or kwargs))

    socket.socket.connect = refuse
    socket.socket.connect_ex = refuse
    socket.create_connection = refuse
    socket.getaddrinfo = refuse


if __name__ == "__main__":
    refuse_network()
    from sphinx.cmd.build import main

    sys.exit(main(sys.argv[1:]))
