"""One module per `ao-mdm` command: its one-line summary (`SUMMARY`), its flags (`define`), the
checks of their values before JAX loads (`check`) and its body, which prints (`run`)."""
