#!/usr/bin/perl

# ram=: llama-server's RAM prompt cache as the hot tier (ram.c).  Sessions
# that leave a slot for another go into llama-server's RAM cache, and come
# back out of it when they return, with no slot action: the reply shows
# their tokens cached, the action is "ram", no file is written for the swap.
# A zone that thinks RAM holds sessions where llama-server has none falls
# back to its files after three misses.  Tenants' zones cannot have ram=.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

# sessions of their own system prompts: llama-server's lookup opens
sub turn {
    my ($t, $sid) = @_;
    return $t->chat_turn($sid, system => join ' ',
                         map { "Rule $_ of house $sid." } 1 .. 30);
}

my $site = LlamaTest->site(
    zone => 'llama_session_zone zone=llama:1m slots=2 store=%%SLOTS%% ram=256m;',
    location => 'add_header X-S-Action $llama_session_action always; '
              . 'add_header X-S-Slot $llama_session_slot always;',
    extra => 'location /api/ { llama_session_api llama; }');

{
    my $t = LlamaTest->new(workers => 2);
    $t->llama(np => 2, ctx => 8192, cache_ram => 256, sps => 0.1);
    $t->nginx($site);

    my %first;
    for my $sid (qw(a b c d)) {
        my $r = turn($t, $sid);
        is($r->{status}, 200, "$sid: first turn");
        $first{$sid} = $r->{prompt};
    }
    ok($t->log_lines(qr/zone "llama" runs two tiers: llama-server's RAM cache/),
       'the zone says it runs two tiers');

    my @files = glob $t->dir . '/slots/*.bin';
    my $ram = 0;
    for my $sid (qw(a b c d)) {
        my $r = turn($t, $sid);
        is($r->{status}, 200, "$sid: second turn");
        $ram++ if ($r->{action} // '') eq 'ram';
        cmp_ok($r->{cached} // 0, '>=', $first{$sid} - 8,
               "$sid: its first prompt cached ($r->{cached} of $r->{prompt}, "
               . ($r->{action} // '') . ')');
    }
    is($ram, 4, 'every return came out of RAM');
    is(scalar(() = glob $t->dir . '/slots/*.bin'), scalar @files,
       'no file written for those swaps');

    my $api = $t->get('/api/sessions/current');
    is($api->{json}{stats}{ram_hits}, 4, 'the API counts 4 RAM hits');
    ok(!$api->{json}{ram_disabled}, 'the tier is on');
    $t->stop;
}

{
    # an empty slot looks up nothing in RAM (upstream 28139): a session in
    # RAM goes to a slot that holds another, not to the empty one
    my $t = LlamaTest->new(workers => 2);
    $t->llama(np => 2, ctx => 8192, cache_ram => 256, sps => 0.1);
    $t->nginx($site);

    my %slot = map { $_ => turn($t, $_)->{slot} } qw(a b);
    my $c = turn($t, 'c');
    my ($out) = grep { $slot{$_} eq $c->{slot} } qw(a b);
    my $other = 1 - $c->{slot};
    my $clear = $t->post("/api/sessions/clear?slot=$other", "");
    is($clear->{status}, 200, "slot $other cleared: empty");
    my $r = turn($t, $out);
    is($r->{action}, 'ram', "$out, in RAM, comes back into slot $c->{slot} "
                            . "that holds c, not into the empty one: "
                            . "$r->{action} on slot $r->{slot}");
    cmp_ok($r->{cached} // 0, '>', 500, "its prompt cached ($r->{cached})");
    $t->stop;
}

{
    # RAM for two sessions (each ~4.6 MB here), six on two slots: a
    # session leaving its slot unsaved goes into RAM only where it pushes
    # out no entry with turns its file lacks; before the zone knows a
    # file's size it is saved first; so no return is re-prefilled
    my $t = LlamaTest->new(workers => 2);
    $t->llama(np => 2, ctx => 8192, cache_ram => 10, sps => 0.1);
    (my $small = $site) =~ s/ram=256m/ram=10m/;
    $t->nginx($small);

    my %first;
    $first{$_} = turn($t, $_)->{prompt} for qw(a b c d e f);

    my (%by, @short);
    for my $round (1, 2) {
        for my $sid (qw(a b c d e f)) {
            my $r = turn($t, $sid);
            $by{$r->{action} // ''}++;
            push @short, "$sid: $r->{cached} of $r->{prompt} ($r->{action})"
                if ($r->{cached} // 0) < $first{$sid} - 8;
        }
    }
    is("@short", '', 'no return re-prefilled under a RAM budget for two of '
                     . 'six: ' . join ' ', map { "$_ $by{$_}" } sort keys %by);
    ok($by{ram}, 'some came out of RAM');
    ok($by{restore}, 'the others from their files');
    ok(!$t->log_lines(qr/left llama-server's RAM cache .* with turns its file lacks/),
       'no session left RAM with turns its file lacks');
    my $api = $t->get('/api/sessions/current');
    is($api->{json}{stats}{ram_lost}, 0, 'the API counts none lost');
    ok(!$api->{json}{ram_disabled}, 'the tier is still on');
    $t->stop;
}

{
    # llama-server without its RAM cache: the zone's model is wrong
    my $t = LlamaTest->new(workers => 2);
    $t->llama(np => 2, ctx => 8192, cache_ram => 0, sps => 0);
    $t->nginx($site);

    turn($t, $_) for qw(a b c d e f);
    my @actions = map { turn($t, $_)->{action} // '' } qw(a b c d e f);
    ok($t->log_lines(qr/3 sessions in a row were not in llama-server's RAM cache where zone "llama" expected/),
       'three misses stop the tier, said once: ' . "@actions");
    my $api = $t->get('/api/sessions/current');
    ok($api->{json}{ram_disabled}, 'the API says so')
        or diag explain $api->{json};
    $t->stop;
}

{
    my $t = LlamaTest->new;
    $t->{llama_port}{llama} = 9;
    my ($rc, $err) = $t->nginx_test(LlamaTest->site(
        zone => 'llama_session_zone zone=llama:1m ram=1g;',
        server => 'llama_session_namespace $http_x_tenant;'));
    ok($rc != 0, 'nginx -t refuses ram= for tenants');
    like($err, qr/"ram=" and a location with llama_session_namespace/,
         'and says why') or diag $err;
    $t->stop;
}

done_testing();
