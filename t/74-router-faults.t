#!/usr/bin/perl

# Router mode when things go wrong, with the real llama-server's router:
# a model no zone drives, a zone whose model the router lacks, a save that
# fails before an unload (the model stays, the other request waits and
# fails clearly, nothing is lost), and a model put to sleep by the router
# (--sleep-idle-seconds: its slots are freed, the module restores from
# the file instead of trusting them).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

my $t = LlamaTest->new(workers => 2);
$t->router(models => { small => 4, big => 12 }, max => 1);

$t->nginx(<<'EOF2');
    llama_session_zone zone=small:1m model=small store=%%SLOTS%%;
    llama_session_zone zone=big:1m model=big store=%%SLOTS%%;
    llama_session_zone zone=ghost:1m model=ghost store=%%SLOTS%%;

    server {
        listen 127.0.0.1:%%PORT%%;

        # loads wait as long as the router takes (a busy machine loads a
        # model slowly); /short/ bounds the wait for the switch that
        # cannot happen, which is what that check is about
        location / {
            llama_session small big ghost;
            llama_session_wait_timeout 120s;
            proxy_pass http://127.0.0.1:%%LLAMA%%;
            add_header X-S-Action $llama_session_action always;
        }

        location /short/ {
            llama_session small big ghost;
            llama_session_wait_timeout 3s;
            proxy_pass http://127.0.0.1:%%LLAMA%%/;
            add_header X-S-Action $llama_session_action always;
        }

        location /_llama_slots/ {
            internal;
            proxy_pass http://127.0.0.1:%%LLAMA%%/;
        }
    }
EOF2

my %conv;

sub turn {
    my ($sid, $model, $path) = @_;
    $conv{$sid} //= [ { role => 'user', content => join ' ', map {
                          "Session $sid keeps note $_." } 1 .. 40 } ];
    my $r = $t->post($path // '/v1/chat/completions',
                     { model => $model, messages => $conv{$sid},
                       max_tokens => 2, temperature => 0 },
                     headers => { 'X-Session-Id' => $sid });
    if ($r->{status} == 200) {
        push @{ $conv{$sid} },
            { role => 'assistant',
              content => $r->{json}{choices}[0]{message}{content} },
            { role => 'user', content => "And then, $sid?" };
    }
    return $r;
}

# a model no zone of the location drives

my $r = turn('n', 'nothing');
is($r->{status}, 400, 'a model no zone drives: 400');
is($r->{json}{error}{type}, 'invalid_request_error', 'with a JSON error');
like($r->{json}{error}{message}, qr/model is not one this server keeps sessions for/,
     'which says why');
is(scalar(grep { $_ ne 'unloaded' } values %{ $t->router_models }), 0,
   'nothing was loaded for it');

# a zone whose model the router does not have

$r = turn('g', 'ghost');
is($r->{status}, 502, 'a zone\'s model the router lacks: 502');
is($r->{json}{error}{type}, 'server_error', 'with a JSON error');
ok($t->log_lines(qr/llama-server's router has no model "ghost" \(zone "ghost"\)/),
   'the error log names the model');

# a save that fails before the unload: the model stays, nothing is lost

$r = turn('a', 'big');
is($r->{status}, 200, 'a on big');
my $prompt = $r->{json}{usage}{prompt_tokens};

chmod 0555, $t->{slots};
$r = turn('b', 'small', '/short/v1/chat/completions');
is($r->{status}, 503, 'b on small while big cannot be saved: 503');
ok($r->{headers}{'retry-after'}, 'with Retry-After');
like($r->{json}{error}{message}, qr/switching models/, 'the JSON says why');
is($t->router_models->{big}, 'loaded', 'big was not unloaded');
ok($t->log_lines(qr/"small" \(zone "small"\) was not up within llama_session_wait_timeout: "big" was to be unloaded/),
   'the error log says which model could not go');

$r = turn('a', 'big');
is($r->{status}, 200, 'a goes on on big meanwhile');
is($r->{headers}{'x-s-action'}, 'hit', 'on its cache');
ok($r->{json}{timings}{cache_n} >= $prompt - 1,
   "all of it: $r->{json}{timings}{cache_n} tokens");
$prompt = $r->{json}{usage}{prompt_tokens};

chmod 02775, $t->{slots};
sleep 1;   # a fixed time: the idle saver's back-off after its failures
my $ok = $t->wait_for(sub { turn('b', 'small')->{status} == 200 }, 30);
ok($ok, 'once big can be saved, b runs on small');
is($t->router_models->{big}, 'unloaded', 'big went');

$r = turn('a', 'big');
is($r->{status}, 200, 'a returns on big');
ok($r->{json}{timings}{cache_n} >= $prompt - 1,
   "with all its turns: $r->{json}{timings}{cache_n} of $r->{json}{usage}{prompt_tokens}");

$t->allow_alerts(qr/Permission denied|saving session/);
$t->stop;

# --- a model the router put to sleep ----------------------------------------

%conv = ();
$t = LlamaTest->new(workers => 2);
$t->router(models => { small => 4 }, max => 1,
           args => [ '--sleep-idle-seconds', 4 ]);

$t->nginx($t->site(
    zone => q{
        llama_session_zone zone=small:1m model=small store=%%SLOTS%%
                           save_idle=500ms;
    },
    location => q{
        llama_session_wait_timeout 60s;
        add_header X-S-Action $llama_session_action always;
    }));

$r = turn('s', 'small');
is($r->{status}, 200, 'a session on small');
$prompt = $r->{json}{usage}{prompt_tokens};

ok($t->wait_for(sub { $t->router_models->{small} eq 'sleeping' }, 30),
   'the router puts small to sleep');
ok($t->log_lines(qr/idle save of "small\@s-/), 'the session was saved before');

$r = turn('s', 'small');
is($r->{status}, 200, 'it returns');
is($r->{headers}{'x-s-action'}, 'restore',
   'from its file, not from a slot the sleep freed');
ok($r->{json}{timings}{cache_n} >= $prompt - 1,
   "all of it: $r->{json}{timings}{cache_n} of $r->{json}{usage}{prompt_tokens}");
ok(!$t->log_lines(qr/lost their turns/),
   'nothing lost: the session was saved before the sleep');

$t->stop;
done_testing;
