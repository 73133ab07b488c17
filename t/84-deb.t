#!/usr/bin/perl

# The Debian package (make deb) on this machine, Debian 12, with its own
# nginx: built lintian-clean, installed, nginx -t with the stock
# /etc/nginx, a session saved and restored through it, the shipped site
# over TLS, an upgrade, the removal (t/lib/LlamaDeb.pm says each step).
# It changes the machine: run as root; it removes the package and its site
# at the end, also on failure.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaDeb;
use Test::More;

$> == 0 or plan skip_all => 'installs a package: needs root';

LlamaDeb::first_hour();

done_testing;
