#!/usr/bin/perl

# A zone with more slots than llama-server has (slots=4, -np 1, as the
# demo once ran examples/nginx.conf): the module uses only the slots
# llama-server has, says so once, and never sends a session to a slot that
# does not exist (llama-server wraps the id onto another session's slot).
# Then a backend that comes back with fewer slots than before (the fake
# one, 4 then 2): no slot call and no request goes to slot 2 or 3 again.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep);

my $conf = LlamaTest->site(
    zone => 'llama_session_zone zone=llama:1m slots=4 store=%%SLOTS%%;',
    location => q{
        llama_session_wait_timeout 120s;
        proxy_read_timeout 300s;
        add_header X-S-Action $llama_session_action always;
        add_header X-S-Slot $llama_session_slot always;
    },
    slots => 'proxy_read_timeout 300s;',
    extra => 'location /api/ { llama_session_api llama; }');

my $t = LlamaTest->new(workers => 2);
$t->llama(np => 1, ctx => 8192);
$t->nginx($conf);

my %conv;
sub body {
    my ($sid) = @_;
    $conv{$sid} //= [ { role => 'user', content => join ' ', map {
                          "Session $sid keeps note $_." } 1 .. 60 } ];
    return { messages => $conv{$sid}, max_tokens => 2, temperature => 0 };
}

# three sessions at once on llama-server's one slot, then each returns

my @h = map { $t->async_post('/v1/chat/completions', body($_),
                               headers => { 'X-Session-Id' => $_ }) } qw(a b c);
my $ok = 0;
for (@h) {
    my $r = $t->async_wait($_);
    $ok++ if $r->{status} == 200 && ($r->{headers}{'x-s-slot'} // '') eq '0';
}
is($ok, 3, 'three sessions at once: each answered 200, on slot 0');
is($t->post('/v1/chat/completions', body('z'),
            headers => { 'X-Session-Id' => 'z' })->{status}, 200,
   'a fourth session takes the slot (whichever of them came last)');

for my $sid (qw(a b c)) {
    my $r = $t->post('/v1/chat/completions', body($sid),
                     headers => { 'X-Session-Id' => $sid });
    is($r->{status}, 200, "$sid returns");
    is($r->{headers}{'x-s-slot'}, 0, "on slot 0");
    is($r->{headers}{'x-s-action'}, 'restore', 'restored from its file');
    ok($r->{json}{timings}{cache_n} >= $r->{json}{usage}{prompt_tokens} - 2,
       "with its cache: $r->{json}{timings}{cache_n} of "
       . "$r->{json}{usage}{prompt_tokens}");
}

my $log = $t->read_file('error.log');
my $said = () = $log =~ /llama-server has 1 slots, zone "llama" has slots=4: the zone uses slots 0 to 0 only/g;
is($said, 1, 'the mismatch is said once, with the fix');
unlike($log, qr/has no slot|wraps/, 'no call to a slot llama-server does not have');

# the API's clear never names a slot llama-server does not have
my $r = $t->post('/api/sessions/clear?slot=2', {});
is($r->{status}, 400, 'clear of slot 2: no such slot');
$r = $t->post('/api/sessions/clear', {});
is($r->{status}, 200, 'clear of every slot');
is(scalar(@{ $r->{json}{cleared} // [] }), 1, 'is a clear of the one slot')
    or diag explain $r->{json};

$t->stop;

# the fake backend: 4 slots, then it restarts with 2

$t = LlamaTest->new(workers => 2);
my $fport = $t->fake(np => 4);
$t->nginx($conf);

for my $sid (qw(a b c d)) {
    $r = $t->post('/v1/chat/completions', body($sid),
                  headers => { 'X-Session-Id' => $sid });
    is($r->{status}, 200, "$sid on the 4-slot backend");
}
my %slot_of = map { $_ => 1 } map {
    ($_->{body} // '') =~ /"id_slot":(\d+)\}$/ ? $1 : () } @{ $t->fake_calls };
is(scalar(keys %slot_of), 4, 'the four sessions took the four slots');

$t->stop_proc('fake', 'TERM');
$t->fake(np => 2, port => $fport);
my $calls = @{ $t->fake_calls };
# a fixed time: a hit on a slot idle that long checks GET /slots first
# (which finds the backend's two slots); nothing shows the slots are idle
sleep 1.2;

my %status;
for my $sid (qw(a b c d d e)) {
    $r = $t->post('/v1/chat/completions', body($sid),
                  headers => { 'X-Session-Id' => $sid });
    $status{$r->{status}}++;
    ok($r->{status} == 200 || $r->{status} == 503,
       "$sid after the restart: $r->{status}");
    ok(!defined $r->{headers}{'x-s-slot'} || $r->{headers}{'x-s-slot'} < 2,
       'never on slot 2 or 3') if $r->{status} == 200;
}
ok(($status{200} // 0) >= 4, 'the sessions go on on the slots there are');
is($t->post('/v1/chat/completions', body('d'),
            headers => { 'X-Session-Id' => 'd' })->{status}, 200,
   'd too');

my @after = @{ $t->fake_calls }[$calls .. $#{ $t->fake_calls }];
my @bad = grep { $_->{path} =~ m{^/slots/[23]\b}
                 || ($_->{body} // '') =~ /"id_slot":[23]\}$/ } @after;
is(scalar(@bad), 0, 'no slot call and no request for slot 2 or 3')
    or diag explain \@bad;

$t->stop;
done_testing;
