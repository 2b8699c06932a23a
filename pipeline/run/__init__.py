"""`crl run` and `crl doctor`: the supervisor that starts, watches and stops a whole run (`supervisor`), and the
checks of a machine and a broker (`doctor`)."""
