#!/usr/bin/perl

# error_log at debug: every event the module arms is one nginx's debug
# lines can name (ngx_event_ident() reads its data as a connection).  A
# worker that stops gracefully arms the stop's event for the saves still
# due (idle.c); with no connection behind it, the worker crashed there
# (signal 11) as soon as the log was at debug.  On the fake backend: two
# sessions on one slot, a swap, an idle save, a graceful stop.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->fake(np => 1);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% '
          . 'save_idle=300ms;',
    location => 'add_header X-S-Action $llama_session_action always;'),
    log_level => 'debug');

for my $who (qw(ann bob ann)) {
    my $r = $t->post('/completion', { prompt => "$who: hello", n_predict => 2 },
                     headers => { 'X-Session-Id' => $who });
    is($r->{status}, 200, "$who: 200");
}

SKIP: {
    skip 'the module is built without --with-debug', 1
        unless $t->log_lines(qr/\[debug\].*llama_session:/);

    ok($t->wait_for(sub { $t->log_lines(qr/idle/i) }, 5),
       'the idle save ran, logged at debug');
}

# the graceful stop (stop()) and no alert, no signal 11
$t->stop;

done_testing;
