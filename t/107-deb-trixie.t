#!/usr/bin/perl

# The Debian package for Debian 13 "trixie" (make deb DEBIAN=trixie),
# built in a Debian 13 root (rig/debian-root.sh: debootstrap, cached) and
# exercised there with Debian 13's own nginx as t/84-deb.t does on this
# machine: built lintian-clean, installed with dpkg -i, nginx -t of the
# stock /etc/nginx with a site and with the shipped site, a session saved
# and restored through it (llama-server on this machine's loopback, which
# the root shares), an upgrade, the removal.  Root only.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaDeb;
use Test::More;

$> == 0 or plan skip_all => 'builds a Debian root and installs into it: '
                           . 'needs root';

LlamaDeb::first_hour(suite => 'trixie');

done_testing;
